"""Request and sampling types shared by the engine, both servers and the router (plain Python, no torch).

The range limits below are the one definition every edge checks against (docs/design.md invariant 9):
the router's OpenAI bodies, the instances' HTTP bodies and SamplingParams itself.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from dataclasses import dataclass, field

_ids = itertools.count()

SEED_LIMIT = 2**63  # seeds are integers in [0, SEED_LIMIT): torch.Generator.manual_seed's range
MAX_TEMPERATURE = 100.0
MAX_OUTPUT_TOKENS = 1 << 20
MAX_TOP_K = 1 << 31
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # top_logprobs per token, OpenAI's limit
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BIAS = 100.0  # |logit_bias value|, OpenAI's range
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|
MAX_REPETITION_PENALTY = 10.0
MAX_N = 128  # choices per request (n)
MAX_GRAMMAR_CHARS = 1 << 20  # a compiled grammar (llguidance's JSON) travels in every body


class Overloaded(RuntimeError):
    """An instance's queue is full: the request was not accepted (HTTP 429 with Retry-After)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens were produced
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already produced
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL-style, over prompt and output tokens (prompt_ids)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    grammar: str | None = None  # an llguidance grammar (engine/constraint.py): a token mask per step
    prompt_ids: tuple[int, ...] = ()  # the prompt, set only when repetition_penalty needs it
    prompt_logprobs: int | None = None  # prefill: each prompt token's logprob and the top k (echo)
    n: int = 1  # choices sampled from one prompt's cache (choice_params(i) is choice i's)
    cache_namespace: str = ""  # not sampling: the prefix cache's namespace (kvcache/radix_cache.py)
    # output ids produced before this request, now the end of its prompt (a request the router
    # migrated: router/migration.py): the penalties and the grammar count them as output; max_tokens,
    # min_tokens and the seed's stream count only the tokens this request produces
    generated: tuple[int, ...] = ()

    def __post_init__(self):
        if not 1 <= self.max_tokens <= MAX_OUTPUT_TOKENS:
            raise ValueError(f"max_tokens must be in [1, {MAX_OUTPUT_TOKENS}], got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        self._check_processing()

    def _check_processing(self) -> None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name} must be a finite number in [-2, 2], got {v}")
        r = self.repetition_penalty
        if not (math.isfinite(r) and 0 < r <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise ValueError(
                    f"logit_bias entries must be (token id >= 0, bias in [-100, 100]), got {tok}: {bias}"
                )
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if self.grammar is not None and not 0 < len(self.grammar) <= MAX_GRAMMAR_CHARS:
            raise ValueError(f"a grammar must have 1 to {MAX_GRAMMAR_CHARS} characters")
        if len(self.generated) > MAX_OUTPUT_TOKENS or any(t < 0 for t in self.generated):
            raise ValueError(f"generated must be at most {MAX_OUTPUT_TOKENS} token ids >= 0")

    def choice_params(self, i: int) -> "SamplingParams":
        """Choice i of n: its own seed stream, seed + i (choice 0 samples as the request with n = 1)."""
        seed = None if self.seed is None else (self.seed + i) % SEED_LIMIT
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def processes_logits(self) -> bool:
        """Anything between the raw logits and temperature / top-k / top-p."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.grammar
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def finish_reason(self, token: int, num_output: int, eos_ids: set[int]) -> str | None:
        """Why a request that just produced `token` (its num_output-th) stops, or None."""
        if token in self.stop_token_ids or (token in eos_ids and not self.ignore_eos):
            return "stop"
        if num_output >= self.max_tokens:
            return "length"
        return None


def choice_id(request_id: str, i: int) -> str:
    """Choice i's request id (n > 1): the request's own for choice 0."""
    return request_id if i == 0 else f"{request_id}/{i}"


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model: log-softmax of the raw logits, before
    logit_bias, penalties, grammar, temperature, top-k and top-p (vLLM's and SGLang's default)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the `logprobs` most likely (id, logprob), most likely first

    def wire(self) -> list:
        """[logprob, [[id, logprob], ...]]: how TransferDone and the decode stream carry it."""
        return [self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, wire: list) -> "TokenLogprob | None":
        return cls(float(wire[0]), tuple((int(i), float(v)) for i, v in wire[1])) if wire else None


class Status(enum.Enum):
    """A request's place in the single-rank lifecycle (engine/scheduler.py's docstring)."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose cache entries are written
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("a request needs at least one prompt token")

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """Cache slots the request can ever need: the prompt plus every token but the last output."""
        return len(self.prompt_ids) + self.params.max_tokens - 1
