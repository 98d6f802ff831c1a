"""OpenAI request bodies (the fields the router honours), response builders and the error body.

Unknown fields are ignored, as OpenAI-compatible servers do. Extensions: `top_k`, `ignore_eos`,
and `return_token_ids` (each choice gets the generated ids as `token_ids`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class ApiError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else
                              "service_unavailable" if status == 503 else "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    return_token_ids: bool = False
    ignore_eos: bool = False
    logprobs: int | bool | None = None  # not served: refused rather than silently ignored

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


def check_sampling(req: _Common, default_max_tokens: int) -> dict:
    """The validated sampling fields (OpenAI defaults: temperature 1, top_p 1) or an ApiError(400)."""
    max_tokens = req.max_tokens
    if max_tokens is None and isinstance(req, ChatRequest):
        max_tokens = req.max_completion_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k is None else req.top_k
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if temperature < 0:
        raise ApiError(400, f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    if top_k < 0:
        raise ApiError(400, f"top_k must be >= 0, got {top_k}", "top_k")
    if req.n != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if getattr(req, "echo", False):
        raise ApiError(400, "echo is not supported", "echo")
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": req.seed, "ignore_eos": req.ignore_eos}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(request_id: str, model: str, chat: bool, chunk: bool) -> dict:
    obj = "chat.completion" if chat else "text_completion"
    return {"id": request_id, "object": obj + ".chunk" if chat and chunk else obj, "created": int(time.time()),
            "model": model}


def choice(chat: bool, chunk: bool, text: str, finish_reason: str | None, token_ids: list[int] | None,
           first: bool = False) -> dict:
    c: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if not chat:
        c["text"] = text
    elif chunk:
        c["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    else:
        c["message"] = {"role": "assistant", "content": text}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c
