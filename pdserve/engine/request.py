"""Request and sampling types shared by the engine and both servers (plain Python, no torch)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

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


class Status(enum.Enum):
    WAITING = "waiting"
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
