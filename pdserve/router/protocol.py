"""OpenAI request bodies (the fields the router honours), response builders and the error body.

A field the router does not know is a 400 naming it (a client must not believe an ignored field was
honoured); every known field is range-checked (docs/design.md invariant 9: non-finite numbers, huge
integers, out-of-range values are a 400 naming the field). Extensions (vLLM's names): `top_k` (-1 or
0: off), `ignore_eos`, `min_tokens`, `repetition_penalty`, `stop_token_ids`, `return_token_ids` (each
choice gets the generated ids as `token_ids`), and response_format types `regex` and `grammar` (Lark)
beside OpenAI's `json_object` / `json_schema` (structured.py). The README's compatibility table
lists every parameter.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from ..request import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_OUTPUT_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SEED_LIMIT,
    SamplingParams,
)
from ..serving.http_edge import StrictModel, error_body, error_type

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 4096
MAX_TOOLS = 128


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


class OpenAIModel(StrictModel):
    """A body of the OpenAI API: a field this router does not know is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class _Common(OpenAIModel):
    model: str = Field(max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    return_token_ids: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_OUTPUT_TOKENS)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    response_format: dict[str, Any] | None = None
    user: str | None = Field(None, max_length=256)
    # vLLM's and SGLang's field: narrows the request's prefix-cache namespace (tenants.py), never widens it
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_OUTPUT_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, bool | int | str | None] | None = Field(None, max_length=16)


RESERVED_TEMPLATE_KWARGS = {
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "pad_token",
}


def template_kwargs(req: ChatRequest) -> dict:
    """chat_template_kwargs (e.g. enable_thinking) for the template; the names the router sets are refused."""
    kwargs = dict(req.chat_template_kwargs or {})
    clash = RESERVED_TEMPLATE_KWARGS & set(kwargs)
    if clash:
        raise ApiError(400, f"chat_template_kwargs must not set {sorted(clash)}", "chat_template_kwargs")
    return kwargs


def check_sampling(req: _Common, default_max_tokens: int, vocab: int) -> SamplingParams:
    """The request's SamplingParams (OpenAI defaults: temperature 1, top_p 1) or an ApiError(400);
    the router adds the grammar and the cache namespace (app.py) before both halves send it.

    Ranges and finiteness are enforced by the body model; this refuses what is valid but not served."""
    max_tokens = req.max_tokens
    if max_tokens is None and isinstance(req, ChatRequest):
        max_tokens = req.max_completion_tokens
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    _check_stop(req.stop_list())
    if req.min_tokens > max_tokens:
        raise ApiError(
            400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
        raise ApiError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
    best_of = getattr(req, "best_of", None) or req.n
    if best_of < req.n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({req.n})", "best_of")
    if best_of > req.n and req.stream:
        raise ApiError(400, "best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    if getattr(req, "suffix", None):
        raise ApiError(400, "suffix is not supported", "suffix")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, vocab),
            n=best_of,  # generated; the best n are returned (respond.collect)
            **_logprobs(req),
        )
    except ValueError as e:  # the body model's ranges are SamplingParams's: a second line of defence
        raise ApiError(400, str(e)) from None


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise ApiError(
                400, f"logit_bias keys must be token ids in [0, {vocab}), got {key[:32]!r}", "logit_bias"
            )
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise ApiError(400, f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def check_response_budget(sampling: SamplingParams, stream: bool, budget: int) -> None:
    """A non-streamed answer is built whole in the router's memory: n x max_tokens x (1 +
    top_logprobs) token entries beyond `budget` (--max-response-budget) are served only streamed."""
    size = sampling.n * sampling.max_tokens * (1 + (sampling.logprobs or 0))
    if size > budget and not stream:
        raise ApiError(
            400,
            f"n x max_tokens x (1 + top_logprobs) is {size}, more than {budget} (--max-response-budget) "
            "for an answer that is not streamed: set stream = true, or ask for fewer",
            "max_tokens",
            "response_too_large",
        )


def _logprobs(req: _Common) -> dict:
    """Completions: logprobs = k (and echo: the prompt's too); chat: logprobs = true, top_logprobs = k."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs = true", "top_logprobs")
        return {"logprobs": (req.top_logprobs or 0) if req.logprobs else None}
    echo_lp = req.logprobs if req.echo and req.logprobs is not None else None
    ranked = (req.best_of or req.n) > req.n  # best_of ranks by the sampled tokens' summed logprobs
    return {"logprobs": 0 if ranked and req.logprobs is None else req.logprobs, "prompt_logprobs": echo_lp}


def _check_stop(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    for s in stops:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise ApiError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens once the prefill answered (its cache hit
    with --report-cached-tokens, else 0: respond.py)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


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
    logprobs: dict | None = None,
) -> dict:
    c: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
    if not chat:
        c["text"] = text
    elif chunk:
        c["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    else:
        c["message"] = {"role": "assistant", "content": text}
    if token_ids is not None:
        c["token_ids"] = token_ids
    return c
