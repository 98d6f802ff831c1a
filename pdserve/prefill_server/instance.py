"""The main-process side of a prefill instance: its ranks, its page bookkeeping, one call per request.

Every rank holds the same slot numbering (full cache) or the same numbering for its own layers
(layer-split), so one PageAllocator here serves all of them. A request's pages stay held after its
prefill until `release()`: the KV hand-off reads them before they are freed.

Prefix cache (`--prefix-cache on`, kvcache/radix_cache.py): `prefill()` looks the prompt up in the
radix tree, locks the longest cached run of whole pages (at most len - 1 tokens: the last position
is always computed, it gives the first token) and prefills only the rest, split across the ranks by
the layout as any chunk is (the cached positions are read, never recomputed). `release()` inserts
the prompt's whole pages into the tree (the pages of a prefix it already held are freed as
duplicates, as is the partial last page) and unlocks. Unreferenced cached pages count as available:
the allocator evicts the least recently used ones when it runs short. The tree is touched by the
worker thread and by admin calls (`capacity`, `flush_cache`), so every change holds `_lock`.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import asdict, dataclass, field

from ..engine.constraint import Grammars
from ..kvcache.page_allocator import PageAllocator
from ..kvcache.radix_cache import Node, RadixCache
from ..model.config import ModelConfig
from ..request import SamplingParams
from ..runtime.launcher import LaunchConfig, RankInstance
from ..runtime.node_group import make_group
from ..runtime.pipe_tensors import from_pipe
from ..transfer.messages import DecodeReservation, Fingerprint, model_hash
from ..transfer.plan import DecodeSide, PrefillSide, Transfer, plan_stream
from ..transfer.rank_commands import (
    SendCmd,
    SenderStatus,
    SenderStatusCmd,
    SendReply,
    StreamedSend,
    merge_checksums,
)
from .cp_backend import layer_owners
from .layouts import check_layout_allowed
from .rank_worker import DumpCacheCmd, PrefillCmd, PrefillRankInfo, PrefillRankWorker
from .worker_config import PrefillWorkerConfig


@dataclass
class PrefillResult:
    request_id: str
    token: int
    logits: object  # torch.Tensor [vocab] when asked for, else None
    slots: list[int]
    cached_len: int = 0  # leading positions read from the prefix cache, not computed
    rank_seconds: tuple[float, ...] = ()  # each rank's wall time in the prefill
    rank_comm_seconds: tuple[float, ...] = ()  # of which in the CP collectives
    logprob: object = None  # TokenLogprob of the first token, with params.logprobs
    prompt_logprobs: list | None = None  # [TokenLogprob | None] per position, with params.prompt_logprobs
    more_first: list = field(default_factory=list)  # n > 1: [(token, TokenLogprob | None)] of choices 1..
    sent: list[SendReply] | None = None  # a streamed hand-off: every rank's SendCmd reply
    computed_at: float = (
        0.0  # time.monotonic() when the last rank finished computing (bench/handoff_overlap.py)
    )


class PrefillInstance(RankInstance):
    def __init__(
        self,
        worker: PrefillWorkerConfig,
        launch: LaunchConfig,
        page_size: int = 16,
        chunk_size: int = 4096,
        prefix_cache: bool = False,
        stream_handoff: bool = True,
    ):
        self.model_config = ModelConfig.from_pretrained(worker.model_dir)
        check_layout_allowed(self.model_config.model_type, worker.layout)
        if worker.moe_ep:
            self.model_config.experts_per_rank(launch.world_size)
        if chunk_size < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk_size}")
        self.worker, self.launch, self.chunk_size = worker, launch, chunk_size
        # hand-offs send each layer's rows as the prefill stores them (prefill_send), not after it
        self.stream_handoff = stream_handoff
        self.allocator = PageAllocator(worker.num_slots // page_size, page_size)
        self.ranks = make_group(PrefillRankWorker, worker, launch)
        self.held: dict[str, list[int]] = {}  # request id -> pages, until release()
        self.rank_infos: list[PrefillRankInfo] = []
        self.cache: RadixCache | None = None
        if prefix_cache:
            self.cache = RadixCache(page_size, self.allocator.free)
            self.allocator.evictor = self.cache
        # held request -> (prompt, locked node, its cache namespace)
        self._cached: dict[str, tuple[list[int], Node, str]] = {}
        self._lock = threading.RLock()
        # grammars compile here, off the loop (the scheduler waits for `ready`); ranks get the mask
        mcfg = self.model_config
        self.grammars = Grammars(worker.model_dir, mcfg.vocab_size, mcfg.eos_token_ids)

    def info(self) -> dict:
        return {
            "model_type": self.model_config.model_type,
            "cp_size": self.launch.world_size,
            "layout": self.worker.layout,
            "cache": self.worker.cache,
            "moe_tp": self.worker.moe_tp,
            "moe_ep": self.worker.moe_ep,
            "chunk_size": self.chunk_size,
            "dtype": self.worker.dtype,
            "ranks": [asdict(r) for r in self.rank_infos],
            **self.capacity(),
        }

    def capacity(self) -> dict:
        """KV tokens: total = free + cached (in the prefix cache, unreferenced: evicted on demand)
        + in use (held by requests, cached prefixes they read included); prefix counters."""
        with self._lock:
            a, cache, ps = self.allocator, self.cache, self.allocator.page_size
            free, cached = a.num_free, cache.evictable_pages if cache else 0
            return {
                "free_tokens": free * ps,
                "total_tokens": a.num_pages * ps,
                "cached_tokens": cached * ps,
                "in_use_tokens": (a.num_pages - free - cached) * ps,
                "prefix_cache": cache is not None,
                "prefix_hit_tokens": cache.hit_tokens if cache else 0,
                "evicted_tokens": cache.evicted_pages * ps if cache else 0,
            }

    def flush_cache(self) -> int:
        """Drops every unreferenced page of the prefix cache; returns the tokens freed."""
        with self._lock:
            return self.cache.flush() * self.allocator.page_size if self.cache else 0

    def prefill(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams | None = None,
        chunk_size: int | None = None,
        want_logits: bool = False,
        prefix_of: str | None = None,
        cached_len: int = 0,
        stream=None,
    ) -> PrefillResult:
        """Runs one prompt through every rank; its pages stay held until release(request_id).

        prefix_of/cached_len: the first cached_len positions are already cached in the pages of the
        held request `prefix_of` (same tokens); only the new tokens are split across the ranks.
        stream(slots, cached_len, chunk_size) -> StreamedSend: a hand-off sent while computing.
        """
        if request_id in self.held:
            raise ValueError(f"request {request_id} is already held")
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if not token_ids or bad:
            raise ValueError("token_ids must be non-empty ids inside the vocabulary")
        if prefix_of is None and self.cache is not None:
            # prompt logprobs (echo) need every position computed: such a prompt is cached, never served
            reuse = params is None or params.prompt_logprobs is None
            namespace = params.cache_namespace if params is not None else ""
            pages, cached_len = self._cached_pages_for(request_id, token_ids, reuse, namespace)
        else:
            with self._lock:
                pages = self._pages_for(token_ids, prefix_of, cached_len)
        try:
            params, first_mask = self._first_mask(params or SamplingParams())
            slots = self.allocator.slots(pages, 0, len(token_ids))
            chunk_size = chunk_size or self.chunk_size
            cmd = PrefillCmd(
                request_id,
                list(token_ids),
                slots,
                chunk_size,
                params,
                cached_len,
                want_logits,
                first_mask,
                stream(slots, cached_len, chunk_size) if stream else None,
            )
            replies = self.ranks.call(cmd)
        except BaseException:
            self._drop(request_id, pages, cached_len)
            raise
        self.held[request_id] = pages
        owner = next(r for r in replies if r.token is not None)
        return PrefillResult(
            request_id,
            owner.token,
            None if owner.logits is None else from_pipe(owner.logits),
            slots,
            cached_len,
            tuple(r.seconds for r in replies),
            tuple(r.comm_seconds for r in replies),
            owner.logprob,
            _merge_prompt_logprobs(replies, len(token_ids)),
            owner.more,
            [r.sent for r in replies] if stream else None,
            max(r.computed_at for r in replies),
        )

    def _first_mask(self, params: SamplingParams) -> tuple[SamplingParams, bytes | None]:
        """(params without the grammar, the grammar's mask for the first token): the ranks apply the
        mask and compile nothing (a copy of the grammar compiled here, once per distinct grammar)."""
        if params.grammar is None:
            return params, None
        matcher = self.grammars.matcher(params.grammar)
        matcher.advance(params.generated, ())  # a migrated request's earlier output first
        mask = matcher.bitmask()
        return dataclasses.replace(params, grammar=None), mask

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

    def _cached_pages_for(
        self, request_id: str, token_ids: list[int], reuse: bool = True, namespace: str = ""
    ) -> tuple[list[int], int]:
        """(pages, cached_len): the cached whole pages of the longest prefix in the request's cache
        namespace (locked; none without reuse) + new pages."""
        with self._lock:
            prefix = token_ids[: len(token_ids) - 1] if reuse else []
            match = self.cache.match(prefix, count=False, namespace=namespace)
            self.cache.lock(match.node)
            cached_len = match.num_pages * self.allocator.page_size
            try:
                pages = match.pages + self.allocator.allocate(len(token_ids) - cached_len)
            except BaseException:  # OutOfPages: the scheduler retries later (counted once, then)
                self.cache.unlock(match.node)
                raise
            self.cache.hit_tokens += cached_len
            self._cached[request_id] = (list(token_ids), match.node, namespace)
            return pages, cached_len

    def _drop(self, request_id: str, pages: list[int], cached_len: int) -> None:
        """A prefill that failed: its own pages go back, its cached prefix is unlocked."""
        with self._lock:
            cached = self._cached.pop(request_id, None)
            if cached is None:
                self.allocator.free(pages)
                return
            self.allocator.free(pages[cached_len // self.allocator.page_size :])
            self.cache.unlock(cached[1])

    def release(self, request_id: str) -> None:
        """The request's pages go back; with the prefix cache its whole pages join the tree."""
        with self._lock:
            pages = self.held.pop(request_id, None)
            if pages is None:
                return
            cached = self._cached.pop(request_id, None)
            if cached is None:
                self.allocator.free(pages)
                return
            token_ids, node, namespace = cached
            self.allocator.free(self.cache.insert(token_ids, pages, namespace))
            self.cache.unlock(node)

    def check_idle(self) -> None:
        """No request holds a page: every page is free or in the prefix cache, unreferenced
        (docs/design.md invariant 7). AssertionError otherwise."""
        with self._lock:
            self.allocator.check_integrity()
            assert not self.held and not self._cached, f"requests still hold pages: {sorted(self.held)}"
            cached = self.cache.cached_pages if self.cache else 0
            assert self.cache is None or self.cache.protected_pages == 0, "a cached prefix is still locked"
            if self.cache is not None:
                self.cache.check_integrity()
            assert self.allocator.num_free + self.allocator.num_held + cached == self.allocator.num_pages

    def dump_cache(self, slots: list[int]) -> list[dict]:
        """Every rank's cache entries at these slots, per layer it holds (for checks)."""
        return [
            {
                layer: (from_pipe(kv), None if idx is None else from_pipe(idx))
                for layer, (kv, idx) in rank.items()
            }
            for rank in self.ranks.call(DumpCacheCmd(slots))
        ]

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
        send_timeout_ms: int = 10_000,
    ) -> dict[int, int]:
        """Every rank sends its share of `plan` from the held request's rows; returns the checksum of
        what went to each decode rank (SendError if a destination accepted nothing for send_timeout_ms).
        The pages stay held: the caller releases them either way."""
        if request_id not in self.held:
            raise KeyError(f"request {request_id} is not held (prefill it first)")
        return merge_checksums(self.ranks.call(SendCmd(room, ticket, plan, endpoints, send_timeout_ms)))

    def prefill_send(
        self,
        room: str,
        token_ids: list[int],
        params: SamplingParams | None,
        decode: DecodeSide,
        start: int,
        ticket: bytes,
        endpoints: dict[int, str],
        send_timeout_ms: int = 10_000,
    ) -> tuple[PrefillResult, dict[int, int]]:
        """A streamed hand-off: prefills the prompt while every rank sends its share of the rows of
        positions [start, n) as they are stored (prefill_server/handoff_stream.py); (the result,
        the checksum per decode rank) once every rank computed and its sends are done or cancelled
        (SendError if a destination took nothing). The pages stay held: the caller releases them."""

        def stream(slots: list[int], cached_len: int, chunk_size: int) -> StreamedSend:
            bounds = list(range(cached_len, len(token_ids), chunk_size))
            plan, segments = plan_stream(self.prefill_side(slots), decode, len(token_ids), start, bounds)
            send = SendCmd(room, ticket, plan, endpoints, send_timeout_ms)
            return StreamedSend(send, tuple(segments))

        result = self.prefill(room, token_ids, params, stream=stream)
        return result, merge_checksums(result.sent)

    def transfer_status(self) -> list[SenderStatus]:
        """Every rank's sender counters (transfer/tcp.py, nixl.py): what a send holds after it returned."""
        return self.ranks.call(SenderStatusCmd())


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
