"""The HTTP contracts between pdserve's processes, declared once (torch-free: the router imports it).

Router -> prefill: POST /v1/prefill `PrefillRequest` -> `PrefillReply`; GET /info -> `PrefillInfo`.
Router -> either:  POST /flush_cache -> `FlushReply` (drops the instance's unreferenced prefix-cache pages).
Router -> decode:  POST /v1/generate `GenerateRequest` -> `GenerateReply`, or with "stream": true
                   NDJSON lines `TokenEvent`* then one `FinishEvent` or `ErrorEvent` (`parse_event`);
                   POST /v1/abort `AbortRequest` -> `AbortReply`; GET /capacity -> `DecodeCapacity`.
Both load answers share `LoadAnswer` (the fields the router chooses by): total / free KV tokens and
`queued`, the requests waiting on the instance (prefill /info also sends it as `queue_depth`, its old
name, for one release; a router reading an older instance takes `queue_depth` when `queued` is absent).

The servers declare their endpoints with these types and the router builds and parses with the same
ones, so a field is named and range-checked in one place. Request bodies are `StrictModel`s (unknown
fields ignored, NaN / infinities refused); answers ignore unknown fields too, so a newer peer's
additions do not break an older reader, while a wrong type fails the parse (ValueError).
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal, Union

from pydantic import Field, StrictBool, StrictInt, model_validator

from .request import (
    MAX_BIAS,
    MAX_GRAMMAR_CHARS,
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
from .serving.http_edge import REQUEST_ID, StrictModel

BOOTSTRAP = r"^tcp://[A-Za-z0-9.\[\]-]{1,253}:[0-9]{1,5}$"  # a prefill's side channel, as /info gives it
CACHE_NAMESPACE = r"^[0-9a-f]{0,64}$"  # a request's prefix-cache namespace: "" (shared) or a digest
FinishReason = Literal["stop", "length", "abort"]
TopLogprobs = list[tuple[StrictInt, float]]  # (token id, logprob), most likely first


class _Sampling(StrictModel):
    """What both halves sample with: the prefill samples the first token, the decode the rest."""

    token_ids: list[int] = Field(min_length=1)
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    request_id: str | None = Field(None, pattern=REQUEST_ID)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_OUTPUT_TOKENS)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, gt=0, le=MAX_REPETITION_PENALTY)
    logit_bias: list[tuple[StrictInt, float]] = Field(default_factory=list, max_length=MAX_LOGIT_BIAS)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the sampled token's + the top k
    grammar: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)  # llguidance's
    n: int = Field(1, ge=1, le=MAX_N)  # choices sampled from one prefill (seed + i for choice i)
    # the prefix caches' namespace, set by the router (router/tenants.py): "" or a hex digest
    cache_namespace: str = Field("", pattern=CACHE_NAMESPACE)
    # a migrated request (router/migration.py): the last `generated` token_ids are output the request
    # it continues already produced; penalties and the grammar count them as output, max_tokens
    # and min_tokens only what comes next. At least one token_id stays the prompt.
    generated: int = Field(0, ge=0, le=MAX_OUTPUT_TOKENS)

    @model_validator(mode="after")
    def _generated_within_prompt(self):
        if self.generated >= len(self.token_ids):
            raise ValueError(
                f"generated ({self.generated}) must be fewer than the token ids ({len(self.token_ids)})"
            )
        return self

    def sampling_params(self, vocab: int, max_tokens: int, **extra) -> SamplingParams:
        """The engine's SamplingParams; ValueError (a 400 at the edge) for ids outside the vocabulary
        or values SamplingParams refuses."""
        if any(not 0 <= t < vocab for t in self.token_ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", [t for t, _ in self.logit_bias]),
        ):
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name} token ids must be in [0, {vocab})")
        if any(abs(b) > MAX_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if self.grammar is not None:
            from .engine.constraint import grammar_error  # llguidance: only bodies with a grammar need it

            error = grammar_error(self.grammar)
            if error:
                raise ValueError(f"grammar: {error[:2000]}")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(self.logit_bias),
            logprobs=self.logprobs,
            grammar=self.grammar,
            prompt_ids=tuple(self.token_ids) if self.repetition_penalty != 1.0 else (),
            n=self.n,
            cache_namespace=self.cache_namespace,
            generated=tuple(self.token_ids[len(self.token_ids) - self.generated :]),
            **extra,
        )


def sampling_fields(p: SamplingParams) -> dict:
    """The inverse of `_Sampling.sampling_params` (without token_ids, max_tokens and prompt_logprobs,
    which each body sets itself): what the router sends both halves. `generated` travels as a count,
    the ids being the end of token_ids."""
    names = (
        "temperature top_p top_k seed ignore_eos stop_token_ids min_tokens presence_penalty "
        "frequency_penalty repetition_penalty logit_bias logprobs grammar n cache_namespace"
    ).split()
    return {name: getattr(p, name) for name in names} | {"generated": len(p.generated)}


# router -> prefill -------------------------------------------------------------------------------
async def checked_params(body: _Sampling, vocab: int, max_tokens: int, **extra) -> SamplingParams:
    """body.sampling_params at an async edge: a body with a grammar is checked on a worker thread
    (llguidance validates a large grammar in seconds; the event loop serves the other requests)."""
    if body.grammar is None:
        return body.sampling_params(vocab, max_tokens, **extra)
    return await asyncio.to_thread(body.sampling_params, vocab, max_tokens, **extra)


class PrefillRequest(_Sampling):
    """With `handoff` the request_id is a room: the cache goes to the decode instance reserving it."""

    chunk_size: int | None = Field(default=None, ge=1, le=1 << 20)
    handoff: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each prompt token's (echo)

    def sampling_params(self, vocab: int, max_tokens: int, **extra) -> SamplingParams:
        return super().sampling_params(vocab, max_tokens, prompt_logprobs=self.prompt_logprobs, **extra)


class Logprob(StrictModel):
    """A token's log-probability (log-softmax of the raw logits) and the most likely alternatives."""

    logprob: float
    top: TopLogprobs = Field(default_factory=list)

    @classmethod
    def from_wire(cls, wire: list) -> "Logprob | None":
        """From TokenLogprob.wire()'s [logprob, [[id, logprob], ...]] ([] -> None)."""
        return cls(logprob=wire[0], top=[tuple(t) for t in wire[1]]) if wire else None


class PrefillReply(StrictModel):
    request_id: str
    first_token: int
    prompt_tokens: int
    seconds: float
    prompt_logprobs: list[Logprob | None] | None = None  # with prompt_logprobs: None for the first token
    cached_tokens: int = Field(0, ge=0)  # leading prompt tokens the prefix cache served (usage)


# router -> decode --------------------------------------------------------------------------------
class GenerateRequest(_Sampling):
    """With `bootstrap` (a prefill's side channel) the cache comes by KV hand-off into room request_id."""

    max_tokens: int = Field(16, ge=1, le=MAX_OUTPUT_TOKENS)
    stream: bool = False
    bootstrap: str | None = Field(default=None, pattern=BOOTSTRAP)


class GenerateReply(StrictModel):
    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[Logprob] | None = None  # one per token, with the request's logprobs


class TokenEvent(StrictModel):
    token: StrictInt
    logprob: Logprob | None = None  # with the request's logprobs
    index: int = Field(0, ge=0, lt=MAX_N)  # the choice (n > 1)


class FinishEvent(StrictModel):
    finish_reason: FinishReason
    request_id: str
    index: int = Field(0, ge=0, lt=MAX_N)  # the choice (n > 1): a stream ends after n of them


class ErrorEvent(StrictModel):
    error: str
    request_id: str
    # the instance failed (a rank died, it stopped), not the request: the request may run elsewhere
    # (the router migrates it: router/migration.py); false: the request itself failed
    lost: StrictBool = False


StreamEvent = Union[TokenEvent, FinishEvent, ErrorEvent]


def event_line(event: StreamEvent) -> str:
    """Defaults left out: a plain request's lines stay {"token": id} and {"finish_reason", "request_id"}."""
    return event.model_dump_json(exclude_defaults=True) + "\n"


def parse_event(line: str) -> StreamEvent:
    """One NDJSON line of a decode stream; ValueError for anything that is not one of the three events."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError(f"a stream line must be an object, got {type(msg).__name__}")
    for key, cls in (("token", TokenEvent), ("finish_reason", FinishEvent), ("error", ErrorEvent)):
        if key in msg:
            return cls.model_validate(msg)
    raise ValueError(f"unknown stream event {line[:200]!r}")


class AbortRequest(StrictModel):
    request_id: str = Field(max_length=256)


class AbortReply(StrictModel):
    aborted: bool  # false: no such live request


class FlushReply(StrictModel):
    flushed_tokens: int = Field(ge=0)  # KV tokens the prefix cache gave back to the free pool


# load answers ------------------------------------------------------------------------------------
class RankInfo(StrictModel):
    rank: int = Field(ge=0)
    pid: int
    cache_bytes: int = Field(ge=0)
    weight_bytes: int | None = Field(None, ge=0)  # parameters and fp8 block scales
    weight_bytes_by_dtype: dict[str, int] | None = None  # "float8_e4m3fn", "bfloat16", "float32", ...
    layers: list[int] | None = None  # prefill ranks: the layers whose cache the rank keeps


class LoadAnswer(StrictModel):
    """What the router chooses an instance by (pool.py)."""

    total_tokens: int = Field(ge=0)
    free_tokens: int | None = Field(None, ge=0)
    queued: int = Field(0, ge=0)  # requests waiting on the instance
    ranks: list[RankInfo] = Field(default_factory=list)
    # prefix cache (kvcache/radix_cache.py): free + cached + in use = total
    cached_tokens: int | None = Field(None, ge=0)  # in the prefix cache, unreferenced (evicted on demand)
    in_use_tokens: int | None = Field(None, ge=0)  # held by requests (cached prefixes they read included)
    prefix_cache: bool | None = None
    prefix_hit_tokens: int | None = Field(None, ge=0)  # cumulative: prompt tokens served from the cache
    evicted_tokens: int | None = Field(None, ge=0)  # cumulative: the router ages its model of the tree by it


class PrefillInfo(LoadAnswer):
    """GET /info of a prefill instance."""

    bootstrap: str | None = Field(None, pattern=BOOTSTRAP)  # its side channel; None: no hand-offs
    model_type: str | None = None
    cp_size: int | None = None
    layout: str | None = None
    cache: str | None = None
    moe_tp: bool | None = None
    moe_ep: bool | None = None
    chunk_size: int | None = None
    dtype: str | None = None
    queue_depth: int | None = Field(None, ge=0)  # the old name of `queued`, sent for one release

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data):
        if isinstance(data, dict) and "queued" not in data and "queue_depth" in data:
            return {**data, "queued": data["queue_depth"]}
        return data


class DecodeCapacity(LoadAnswer):
    """GET /capacity of a decode instance."""

    page_size: int | None = None
    bytes_per_token_per_rank: int | None = None
    index_mode: str | None = None
    tp_size: int | None = None
    dcp_size: int | None = None
    moe_ep: bool | None = None  # routed experts by id across the ranks
    kv_cache_dtype: str | None = None
    kv_tokens_from: str | None = None  # what sized total_tokens: a flag (--gpu-memory-utilization: the ranks)
    dtype: str | None = None
    held_tokens: int | None = None  # pages held after failed hand-offs (quarantine)
    running: int | None = None
    transfers_pending: int | None = None
    transfers_completed: int | None = None
    transfers_failed: int | None = None
    transfer_bytes: int | None = None
    transfer_seconds: float | None = None
    transfer_skipped_bytes: int | None = None  # payload the prefix cache kept off the wire


LOAD_PATHS = {"prefill": ("/info", PrefillInfo), "decode": ("/capacity", DecodeCapacity)}
