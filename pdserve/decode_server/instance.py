"""The main-process side of a decode instance: its ranks and its page bookkeeping.

One global slot numbering for the whole instance (docs/design.md invariant 4): pages are page_size
slots, page_size a multiple of C_d, so a page's slots are spread evenly over the DCP group and a
request's token p lands on group rank p % C_d. The scheduler decides; this class executes.

Prefix cache (`--prefix-cache on`, kvcache/radix_cache.py): the tree holds whole pages of finished
requests (prompt and generated tokens); the scheduler locks a new request's cached prefix and
reserves the rest, and the reservation tells the prefill side how many leading tokens it holds
(`cached_len`, whole pages), so the hand-off ships only the rest. Cached rows stay on their ranks
(slot s on rank s % C_d) and the new slots continue the numbering, since pages are C_d-aligned.
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine.batch_sampler import SampleRow
from ..kvcache.page_allocator import PageAllocator
from ..kvcache.radix_cache import RadixCache
from ..model.config import ModelConfig
from ..runtime.launcher import LaunchConfig, RankInstance
from ..runtime.node_group import make_group
from ..runtime.pipe_tensors import from_pipe
from ..transfer.frames import new_ticket
from ..transfer.messages import DecodeReservation, Fingerprint, model_hash
from ..transfer.plan import DecodeSide, PrefillSide, Transfer, plan_transfer
from ..transfer.rank_commands import (
    ExpectCmd,
    ForgetCmd,
    ListenerStatusCmd,
    ReceiverStatus,
    RoomStatus,
    StageCmd,
    TransferStatusCmd,
)
from ..transfer.room_rows import ANY_SRC, RoomSlots
from .rank_worker import (
    CopyCmd,
    DecodeRankInfo,
    DecodeRankWorker,
    DumpCmd,
    ForgetSamplingCmd,
    InfoCmd,
    LoadCmd,
    RankRows,
    ReconfigureCmd,
    SamplingStreamsCmd,
    SelectionsCmd,
    StepCmd,
    StepResult,
)
from .worker_config import DecodeWorkerConfig


class DecodeInstance(RankInstance):
    def __init__(
        self,
        worker: DecodeWorkerConfig,
        launch: LaunchConfig,
        page_size: int = 16,
        prefix_cache: bool = False,
    ):
        if page_size % worker.dcp_size:
            raise ValueError(f"page size {page_size} must be a multiple of --dcp-size {worker.dcp_size}")
        if launch.world_size % worker.dcp_size:
            raise ValueError(f"--dcp-size {worker.dcp_size} must divide --tp-size {launch.world_size}")
        self.model_config = ModelConfig.from_pretrained(worker.model_dir)
        if self.model_config.num_heads % launch.world_size:
            raise ValueError(
                f"{self.model_config.num_heads} heads cannot be split over --tp-size {launch.world_size}"
            )
        if worker.moe_ep:
            self.model_config.experts_per_rank(launch.world_size)
        # the ranks size the pool from their GPUs' memory when num_slots is None: pages of this size
        self.worker, self.launch = dataclasses.replace(worker, page_size=page_size), launch
        self.page_size, self.prefix_cache = page_size, prefix_cache
        self.allocator: PageAllocator | None = None
        self.cache: RadixCache | None = None
        if worker.num_slots is not None:
            self._make_allocator(worker.num_slots)
        self.handoff_skipped_bytes = 0  # payload the prefix cache kept off the wire (reservations)
        self.ranks = make_group(DecodeRankWorker, worker, launch)
        self.rank_infos: list[DecodeRankInfo] = []
        self._last_plan: tuple[tuple, list[Transfer]] | None = (
            None  # reservation, expect_totals, handoff_bytes share it
        )

    def _make_allocator(self, num_slots: int) -> None:
        self.allocator = PageAllocator(num_slots // self.page_size, self.page_size)
        if self.prefix_cache:
            self.cache = RadixCache(self.page_size, self.allocator.free)
            self.allocator.evictor = self.cache

    def start(self):
        super().start()
        if self.allocator is None:  # the ranks agreed on the slots their GPUs hold
            self._make_allocator(self.rank_infos[0].num_slots)
        return self

    def slots(self, pages: list[int], n: int) -> list[int]:
        return self.allocator.slots(pages, 0, n)

    def load(self, pages: list[int], kv: torch.Tensor, index: dict[int, torch.Tensor]) -> None:
        """Stores a prompt's cache ([L, P, c + rope] and index keys) in the pages reserved for it."""
        self.ranks.call(LoadCmd(self.slots(pages, kv.shape[1]), kv, index))

    def copy_prompt(self, src_pages: list[int], dst_pages: list[list[int]], n_tokens: int) -> None:
        """The first n_tokens positions of the request in src_pages copied into each dst page list."""
        if dst_pages:
            self.ranks.call(
                CopyCmd(self.slots(src_pages, n_tokens), [self.slots(p, n_tokens) for p in dst_pages])
            )

    def step(
        self,
        token_ids: list[int],
        pages: list[list[int]],
        lengths: list[int],
        request_ids: tuple[str, ...] = (),
    ) -> torch.Tensor:
        """One decode step over requests with these pages and context lengths; returns logits [B, vocab]
        (checks: serving samples on rank 0, `sample_step`).
        CommandFailed when a rank raised (the group stays usable); RankError when the group broke."""
        cmd = StepCmd(token_ids, pages, lengths, self.allocator.page_size, tuple(request_ids))
        return from_pipe(self.ranks.call(cmd)[0])  # rank 0's logits

    def sample_step(
        self,
        token_ids: list[int],
        pages: list[list[int]],
        lengths: list[int],
        rows: list[SampleRow],
        forget: tuple[str, ...] = (),
        logits: bool = False,
    ) -> StepResult:
        """One decode step whose next tokens rank 0 samples (one SampleRow per request): its
        StepResult, with the [B, vocab] logits as a tensor when `logits` asks for them (checks).
        `forget`: ended requests whose generators rank 0 drops first. Raises as step() does."""
        ids = tuple(r.request_id for r in rows)
        cmd = StepCmd(token_ids, pages, lengths, self.allocator.page_size, ids, tuple(rows), forget, logits)
        result = self.ranks.call(cmd)[0]
        if result.logits is not None:
            result = dataclasses.replace(result, logits=from_pipe(result.logits))
        return result

    def forget_sampling(self, request_ids: tuple[str, ...]) -> None:
        """Rank 0 drops these requests' generators (they ended, and no step carries the news)."""
        self.ranks.call(ForgetSamplingCmd(tuple(request_ids)))

    def sampling_streams(self) -> list[str]:
        """The requests rank 0 holds a generator for (checks)."""
        return self.ranks.call(SamplingStreamsCmd())[0]

    def dump(self, slots: list[int]) -> list[RankRows]:
        return [  # the ranks send runtime/pipe_tensors.py wire
            RankRows(
                d.slots,
                {layer: from_pipe(t) for layer, t in d.kv.items()},
                {layer: from_pipe(t) for layer, t in d.index.items()},
            )
            for d in self.ranks.call(DumpCmd(slots))
        ]

    def reconfigure(self, index_mode: str, comm: str) -> None:
        """Switches the index mode and merge backend on running ranks; clears every cache."""
        self.rank_infos = self.ranks.call(ReconfigureCmd(index_mode, comm))

    def selections(self) -> list[dict[int, torch.Tensor]]:
        """Every rank's selected positions of the last step, per indexer layer ([B, k], -1 padded)."""
        return [
            {layer: from_pipe(wire) for layer, wire in rank.items()}
            for rank in self.ranks.call(SelectionsCmd())
        ]

    def rank_info(self) -> list[DecodeRankInfo]:
        return self.ranks.call(InfoCmd())

    # ---- KV hand-off (transfer/decode_room.py) ------------------------------------------------------
    @property
    def index_mode(self) -> str:
        return self.rank_infos[0].index_mode  # follows reconfigure()

    def fingerprint(self) -> Fingerprint:
        w, cfg = self.worker, self.model_config
        return Fingerprint(
            model_hash(w.model_dir),
            w.kv_cache_dtype,
            w.dtype,
            self.allocator.page_size,
            cfg.num_layers,
            w.dcp_size,
            self.index_mode,
        )

    def reservation(
        self,
        room: str,
        pages: list[int],
        generation: int = 0,
        prompt_len: int | None = None,
        expect: bool = False,
        cached_len: int = 0,
    ) -> DecodeReservation:
        """A new ticket for the room, and every rank staged for it (StageCmd): each rank's endpoint,
        NIXL's with a receive region sized for the rows it stores of a prompt_len-token prompt
        (default: every reserved slot). expect: in the same round trip every rank also expects its
        row total (expect_totals). cached_len: the first positions are held already (prefix cache,
        whole pages): neither expected nor writable by the room. RuntimeError, with nothing left
        staged, when a rank cannot."""
        ticket = new_ticket()  # 128 random bits: late frames of an earlier use of a room id, or frames
        # of a sender that holds another room's ticket, never match it
        n = len(pages) * self.allocator.page_size if prompt_len is None else prompt_len
        rows: dict[int, dict[str, int]] = {}
        for t in self._any_prefill_plan(pages, n, cached_len):
            per = rows.setdefault(t.dst_rank, {})
            per[t.kind] = per.get(t.kind, 0) + t.rows
        totals = self._expect_totals_cmd(room, ticket, pages, n, cached_len) if expect else None
        replies = self.ranks.call(StageCmd(room, ticket, rows, totals))
        errors = [f"decode rank {rank}: {r.error}" for rank, r in enumerate(replies) if r.error]
        if errors:
            self.forget(room, quiesced=True)  # nothing was sent for this ticket
            raise RuntimeError("; ".join(errors))
        return DecodeReservation(
            room,
            self.fingerprint(),
            generation,
            self.launch.world_size,
            self.worker.dcp_size,
            self.allocator.page_size,
            tuple(pages),
            {rank: r.endpoint for rank, r in enumerate(replies)},
            ticket,
            cached_len,
        )

    def decode_side(self, pages: list[int]) -> DecodeSide:
        return DecodeSide(
            self.launch.world_size, self.worker.dcp_size, self.index_mode, self.allocator.page_size, pages
        )

    def room_slots(self, pages: list[int]) -> RoomSlots:
        """The pool rows the room owns on each rank: receivers refuse rows anywhere else (transfer/room_rows.py)."""
        return RoomSlots.of(pages, self.allocator.page_size, self.worker.dcp_size, self.index_mode)

    def expect(self, room: str, ticket: bytes, plan: list[Transfer], pages: list[int]) -> None:
        """Every rank starts accepting its rows of `plan` for this room, in these pages (before anything is sent)."""
        expected: dict[int, dict[int, int]] = {}
        for t in plan:
            per_src = expected.setdefault(t.dst_rank, {})
            per_src[t.src_rank] = per_src.get(t.src_rank, 0) + t.rows
        self.ranks.call(ExpectCmd(room, ticket, expected, self.room_slots(pages)))

    def expect_totals(self, room: str, ticket: bytes, pages: list[int], prompt_len: int) -> None:
        """Like expect(), without the prefill's plan: each rank's row total is fixed by the decode
        layout alone (a one-rank prefill plan has the same rows per destination as any other)."""
        self.ranks.call(self._expect_totals_cmd(room, ticket, pages, prompt_len))

    def _expect_totals_cmd(
        self, room: str, ticket: bytes, pages: list[int], prompt_len: int, cached_len: int = 0
    ) -> ExpectCmd:
        totals: dict[int, dict[int, int]] = {}
        for t in self._any_prefill_plan(pages, prompt_len, cached_len):
            per = totals.setdefault(t.dst_rank, {ANY_SRC: 0})
            per[ANY_SRC] += t.rows
        # the cached pages are shared with other requests: no frame of this room may land in them
        return ExpectCmd(
            room, ticket, totals, self.room_slots(pages[cached_len // self.allocator.page_size :])
        )

    def _any_prefill_plan(self, pages: list[int], prompt_len: int, cached_len: int = 0) -> list[Transfer]:
        """A one-rank prefill's plan into these pages (rows per decode rank are the same for any prefill
        layout); the last one is kept, as a room's reservation asks for the same plan three times."""
        key = (tuple(pages), prompt_len, cached_len, self.index_mode)
        if self._last_plan is None or self._last_plan[0] != key:
            cfg = self.model_config
            any_prefill = PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(prompt_len))
            plan = plan_transfer(any_prefill, self.decode_side(pages), prompt_len, cached_len)
            self._last_plan = (key, plan)
        return self._last_plan[1]

    def handoff_bytes(self, pages: list[int], prompt_len: int, cached_len: int = 0) -> int:
        """Payload bytes a hand-off of positions [cached_len, prompt_len) into these pages carries
        (rows travel in the model dtype, whatever the cache stores)."""
        cfg, itemsize = (
            self.model_config,
            torch.empty(0, dtype=getattr(torch, self.worker.dtype)).element_size(),
        )
        width = {"kv": cfg.kv_entry_dim, "index": cfg.index_head_dim}
        plan = self._any_prefill_plan(pages, prompt_len, cached_len)
        return sum(t.rows * width[t.kind] * itemsize for t in plan)

    def flush_cache(self) -> int:
        """Drops every unreferenced page of the prefix cache (engine thread); returns the tokens freed."""
        return self.cache.flush() * self.allocator.page_size if self.cache else 0

    def cache_counters(self) -> dict:
        """The load answer's prefix-cache fields (engine thread): free + cached + in use = total."""
        a, cache, ps = self.allocator, self.cache, self.allocator.page_size
        free, cached = a.num_free, cache.evictable_pages if cache else 0
        return {
            "cached_tokens": cached * ps,
            "in_use_tokens": (a.num_pages - free - cached) * ps,
            "prefix_cache": cache is not None,
            "prefix_hit_tokens": cache.hit_tokens if cache else 0,
            "evicted_tokens": cache.evicted_pages * ps if cache else 0,
            "transfer_skipped_bytes": self.handoff_skipped_bytes,
        }

    def transfer_status(self, room: str) -> list[ReceiverStatus]:
        """Every rank's receiver counters and its view of the room."""
        return self.ranks.call(TransferStatusCmd(room))

    def room_status(self, room: str) -> list[RoomStatus]:
        return [s.room for s in self.transfer_status(room)]

    def listener_problem(self) -> str | None:
        """Why a rank's data-path receiver thread cannot receive (dead or wedged), or None. A rank
        call: only from the thread that owns the ranks (decode_server/handoff_rooms.py caches it for /health)."""
        problems = [
            f"decode rank {rank}: {s.problem}"
            for rank, s in enumerate(self.ranks.call(ListenerStatusCmd()))
            if s.problem
        ]
        return "; ".join(problems) or None

    def forget(self, room: str, quiesced: bool = False) -> float:
        """Every rank drops the room; quiesced: no sender will write for it any more (transfer/nixl.py).
        Returns how long the room's pages must stay unused (0: at once): NIXL WRITEs land in the pool,
        so a room dropped while senders may still be writing holds its pages for the quarantine."""
        replies = self.ranks.call(ForgetCmd(room, quiesced))
        return max((r.hold_s for r in replies), default=0.0)
