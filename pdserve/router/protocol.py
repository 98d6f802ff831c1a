"""OpenAI request bodies (the fields the router honours), response builders and the error body.

Unknown fields are ignored, as OpenAI-compatible servers do; every known field is range-checked
(docs/design.md invariant 9: non-finite numbers, huge integers, out-of-range values are a 400 naming the
field). Extensions: `top_k` (-1 or 0: off), `ignore_eos`, and `return_token_ids` (each choice gets
the generated ids as `token_ids`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import Field

from ..engine.http_edge import StrictModel, error_body, error_type
from ..engine.request import MAX_OUTPUT_TOKENS, MAX_TEMPERATURE, MAX_TOP_K, SEED_LIMIT

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 4096
MAX_N = 128


class ApiError(Exception):
    """Becomes {"error": {"message", "type", "param", "code"}} with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or error_type(status)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code),
            status_code=self.status,
            headers=self.headers,
        )


class StreamOptions(StrictModel):
    include_usage: bool = False


class _Common(StrictModel):
    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    return_token_ids: bool = False
    ignore_eos: bool = False
    logprobs: int | bool | None = None  # not served: refused rather than silently ignored
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # only 0 is served (see check_sampling)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, max_length=256)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)


def check_sampling(req: _Common, default_max_tokens: int) -> dict:
    """The validated sampling fields (OpenAI defaults: temperature 1, top_p 1) or an ApiError(400).

    Ranges and finiteness are enforced by the body model; this refuses what is valid but not served."""
    max_tokens = req.max_tokens
    if max_tokens is None and isinstance(req, ChatRequest):
        max_tokens = req.max_completion_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = 0 if req.top_k in (None, -1) else req.top_k
    _check_stop(req.stop_list())
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(req, name) not in (None, off):
            raise ApiError(400, f"{name} is not supported (only {off:g})", name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if getattr(req, "best_of", None) not in (None, 1):
        raise ApiError(400, "only best_of = 1 is supported", "best_of")
    if getattr(req, "suffix", None):
        raise ApiError(400, "suffix is not supported", "suffix")
    if req.n != 1:
        raise ApiError(400, "only n = 1 is supported", "n")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if getattr(req, "echo", False):
        raise ApiError(400, "echo is not supported", "echo")
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": req.seed,
        "ignore_eos": req.ignore_eos,
    }


def _check_stop(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    for s in stops:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise ApiError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(request_id: str, model: str, chat: bool, chunk: bool) -> dict:
    obj = "chat.completion" if chat else "text_completion"
    return {
        "id": request_id,
        "object": obj + ".chunk" if chat and chunk else obj,
        "created": int(time.time()),
        "model": model,
    }


def choice(
    chat: bool,
    chunk: bool,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None,
    first: bool = False,
) -> dict:
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
