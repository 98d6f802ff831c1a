"""The main-process side of a prefill instance: its ranks, its page bookkeeping, one call per request.

Every rank holds the same slot numbering (full cache) or the same numbering for its own layers
(layer-split), so one PageAllocator here serves all of them. A request's pages stay held after its
prefill until `release()`: the KV hand-off reads them before they are freed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from ..engine.launcher import LaunchConfig, RankGroup, RankInstance
from ..engine.page_allocator import PageAllocator
from ..engine.request import SamplingParams
from ..model.config import ModelConfig
from ..transfer.messages import DecodeReservation, Fingerprint, model_hash
from ..transfer.plan import PrefillSide, Transfer
from ..transfer.rank_commands import SendCmd, TransferStatusCmd, merge_checksums
from .cp_backend import layer_owners
from .layouts import check_layout_allowed
from .rank_worker import DumpCacheCmd, PrefillCmd, PrefillRankInfo, PrefillRankWorker, PrefillWorkerConfig


@dataclass
class PrefillResult:
    request_id: str
    token: int
    logits: object  # torch.Tensor [vocab] when asked for, else None
    slots: list[int]
    rank_seconds: tuple[float, ...] = ()  # each rank's wall time in the prefill
    rank_comm_seconds: tuple[float, ...] = ()  # of which in the CP collectives
    logprob: object = None  # TokenLogprob of the first token, with params.logprobs
    prompt_logprobs: list | None = None  # [TokenLogprob | None] per position, with params.prompt_logprobs
    more_first: list = field(default_factory=list)  # n > 1: [(token, TokenLogprob | None)] of choices 1..


class PrefillInstance(RankInstance):
    def __init__(
        self, worker: PrefillWorkerConfig, launch: LaunchConfig, page_size: int = 16, chunk_size: int = 4096
    ):
        self.model_config = ModelConfig.from_pretrained(worker.model_dir)
        check_layout_allowed(self.model_config.model_type, worker.layout)
        if chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
        self.worker, self.launch, self.chunk_size = worker, launch, chunk_size
        self.allocator = PageAllocator(worker.num_slots // page_size, page_size)
        self.ranks = RankGroup(PrefillRankWorker, worker, launch)
        self.held: dict[str, list[int]] = {}  # request id -> pages, until release()
        self.rank_infos: list[PrefillRankInfo] = []

    def info(self) -> dict:
        return {
            "model_type": self.model_config.model_type,
            "cp_size": self.launch.world_size,
            "layout": self.worker.layout,
            "cache": self.worker.cache,
            "moe_tp": self.worker.moe_tp,
            "chunk_size": self.chunk_size,
            "dtype": self.worker.dtype,
            "ranks": [asdict(r) for r in self.rank_infos],
            "free_tokens": self.allocator.num_free * self.allocator.page_size,
            "total_tokens": self.allocator.num_pages * self.allocator.page_size,
        }

    def prefill(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams | None = None,
        chunk_size: int | None = None,
        want_logits: bool = False,
        prefix_of: str | None = None,
        cached_len: int = 0,
    ) -> PrefillResult:
        """Runs one prompt through every rank; its pages stay held until release(request_id).

        prefix_of/cached_len: the first cached_len positions are already cached in the pages of the
        held request `prefix_of` (same tokens); only the new tokens are split across the ranks.
        """
        if request_id in self.held:
            raise ValueError(f"request {request_id} is already held")
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if not token_ids or bad:
            raise ValueError("token_ids must be non-empty ids inside the vocabulary")
        pages = self._pages_for(token_ids, prefix_of, cached_len)
        try:
            slots = self.allocator.slots(pages, 0, len(token_ids))
            cmd = PrefillCmd(
                request_id,
                list(token_ids),
                slots,
                chunk_size or self.chunk_size,
                params or SamplingParams(),
                cached_len,
                want_logits,
            )
            replies = self.ranks.call(cmd)
        except BaseException:
            self.allocator.free(pages)
            raise
        self.held[request_id] = pages
        owner = next(r for r in replies if r.token is not None)
        return PrefillResult(
            request_id,
            owner.token,
            owner.logits,
            slots,
            tuple(r.seconds for r in replies),
            tuple(r.comm_seconds for r in replies),
            owner.logprob,
            _merge_prompt_logprobs(replies, len(token_ids)),
            owner.more,
        )

    def _pages_for(self, token_ids: list[int], prefix_of: str | None, cached_len: int) -> list[int]:
        if prefix_of is None:
            if cached_len:
                raise ValueError("cached_len needs prefix_of (the held request that cached those tokens)")
            return self.allocator.allocate(len(token_ids))
        if not 0 < cached_len < len(token_ids):
            raise ValueError(f"cached_len must be in [1, {len(token_ids) - 1}], got {cached_len}")
        # Copy-free prefix reuse: the new request takes over the prefix request's pages.
        prefix_pages = self.held.pop(prefix_of)
        ps = self.allocator.page_size
        if cached_len % ps:
            raise ValueError(f"cached_len must be a multiple of the page size {ps} to share pages")
        keep = prefix_pages[: cached_len // ps]
        self.allocator.free(prefix_pages[cached_len // ps :])
        return keep + self.allocator.allocate(len(token_ids) - cached_len)

    def release(self, request_id: str) -> None:
        pages = self.held.pop(request_id, None)
        if pages is not None:
            self.allocator.free(pages)

    def dump_cache(self, slots: list[int]) -> list[dict]:
        """Every rank's cache entries at these slots, per layer it holds (for checks)."""
        return self.ranks.call(DumpCacheCmd(slots))

    # ---- KV hand-off (transfer/prefill_room.py: this instance is its KVSource) ------------------------------------------------------
    def handoff_fingerprint(self, reservation: DecodeReservation) -> Fingerprint:
        """What the prefill side asserts: its model, dtype and layer count; the layout fields it
        will pack for are the reservation's (the prefill packs for any layout)."""
        return dataclasses.replace(
            reservation.fingerprint,
            model_hash=model_hash(self.worker.model_dir),
            model_dtype=self.worker.dtype,
            num_layers=self.model_config.num_layers,
        )

    def prefill_side(self, slots: list[int]) -> PrefillSide:
        """This instance's side of a transfer plan for a prompt stored at these prefill slots."""
        cfg = self.model_config
        return PrefillSide(
            self.launch.world_size, self.worker.cache, cfg.num_layers, cfg.indexer_layers, slots
        )

    def layer_owners(self) -> list[int]:
        return layer_owners(self.model_config.num_layers, self.launch.world_size)

    def send(
        self,
        request_id: str,
        room: str,
        ticket: bytes,
        plan: list[Transfer],
        endpoints: dict[int, str],
        corrupt: bool = False,
        send_timeout_ms: int = 10_000,
    ) -> dict[int, int]:
        """Every rank sends its share of `plan` from the held request's rows; returns the checksum of
        what went to each decode rank (SendError if a destination accepted nothing for send_timeout_ms).
        The pages stay held: the caller releases them either way."""
        if request_id not in self.held:
            raise KeyError(f"request {request_id} is not held (prefill it first)")
        return merge_checksums(
            self.ranks.call(SendCmd(room, ticket, plan, endpoints, corrupt, send_timeout_ms))
        )

    def transfer_status(self) -> list[dict]:
        """Every rank's sender counters (transfer/tcp.py, nixl.py): what a send holds after it returned."""
        return self.ranks.call(TransferStatusCmd(""))


def _merge_prompt_logprobs(replies, n: int) -> list | None:
    """[None (the first token has none), logprob of token 1, ...] from every rank's own positions;
    positions served from a cached prefix stay None."""
    if replies[0].prompt_logprobs is None:
        return None
    out: list = [None] * n
    for r in replies:
        for p, lp in r.prompt_logprobs.items():
            out[p + 1] = lp
    return out
