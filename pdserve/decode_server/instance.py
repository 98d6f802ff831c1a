"""The main-process side of a decode instance: its ranks and its page bookkeeping.

One global slot numbering for the whole instance (DESIGN.md invariant 4): pages are page_size
slots, page_size a multiple of C_d, so a page's slots are spread evenly over the DCP group and a
request's token p lands on group rank p % C_d. The scheduler decides; this class executes.
"""

from __future__ import annotations

import torch

from ..engine.launcher import LaunchConfig, RankGroup
from ..engine.page_allocator import PageAllocator
from ..model.config import ModelConfig
from .rank_worker import DecodeRankWorker, DecodeWorkerConfig, DumpCmd, LoadCmd, ReconfigureCmd, StepCmd


class DecodeInstance:
    def __init__(self, worker: DecodeWorkerConfig, launch: LaunchConfig, page_size: int = 16):
        if page_size % worker.dcp_size:
            raise ValueError(f"page size {page_size} must be a multiple of --dcp-size {worker.dcp_size}")
        if launch.world_size % worker.dcp_size:
            raise ValueError(f"--dcp-size {worker.dcp_size} must divide --tp-size {launch.world_size}")
        self.model_config = ModelConfig.from_pretrained(worker.model_dir)
        if self.model_config.num_heads % launch.world_size:
            raise ValueError(f"{self.model_config.num_heads} heads cannot be split over --tp-size {launch.world_size}")
        self.worker, self.launch = worker, launch
        self.allocator = PageAllocator(worker.num_slots // page_size, page_size)
        self.ranks = RankGroup(DecodeRankWorker, worker, launch)
        self.rank_infos: list[dict] = []

    def start(self) -> "DecodeInstance":
        self.rank_infos = self.ranks.start()
        return self

    def shutdown(self) -> None:
        self.ranks.shutdown()

    def __enter__(self) -> "DecodeInstance":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def slots(self, pages: list[int], n: int) -> list[int]:
        return self.allocator.slots(pages, 0, n)

    def load(self, pages: list[int], kv: torch.Tensor, index: dict[int, torch.Tensor]) -> None:
        """Stores a prompt's cache ([L, P, c + rope] and index keys) in the pages reserved for it."""
        self.ranks.call(LoadCmd(self.slots(pages, kv.shape[1]), kv, index))

    def step(self, token_ids: list[int], pages: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """One decode step over requests with these pages and context lengths; returns logits [B, vocab]."""
        return self.ranks.call(StepCmd(token_ids, pages, lengths, self.allocator.page_size))[0]

    def dump(self, slots: list[int]) -> list[dict]:
        return self.ranks.call(DumpCmd(slots))

    def reconfigure(self, index_mode: str, comm: str) -> None:
        """Switches the index mode and merge backend on running ranks; clears every cache."""
        self.rank_infos = self.ranks.call(ReconfigureCmd(index_mode, comm))

    def rank_info(self) -> list[dict]:
        return self.ranks.call("info")
