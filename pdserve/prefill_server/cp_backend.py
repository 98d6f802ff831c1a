"""Prefill context-parallel attention backend (article section 2.1).

A prefill chunk [c0, c1) is split across the C ranks by the layout; each rank runs the model on
its own tokens only. In every attention layer:
  1. each rank has computed the latent entries (and, in indexer layers, the index keys) of its
     own tokens; one all-gather (a second one for index keys) hands them to every rank;
  2. they are put back in token order and stored (see the two storage modes below);
  3. each rank runs the indexer and attention for its own queries over the context [0, c1).
Storage:
  full         every rank keeps every layer's entries in its pool.
  layer-split  rank r keeps a contiguous block of layers. For any other layer the context lives
               only in a temporary buffer while that layer is computed: the current chunk's
               entries come from the all-gather, and earlier chunks' entries are broadcast by the
               owner, one layer ahead (async) so the transfer overlaps the previous layer's work.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..engine.attn_ops import TorchOps
from ..engine.prefill_attention import prefill_attention
from ..kvcache.kv_cache import KVPool
from ..model.backend import IndexerInputs
from ..model.config import ModelConfig
from ..runtime.collectives import all_gather_rows


def layer_owners(num_layers: int, cp_size: int) -> list[int]:
    """Rank that stores each layer in layer-split mode: contiguous, as even as possible."""
    return [
        min(r for r in range(cp_size) if layer < (r + 1) * num_layers // cp_size)
        for layer in range(num_layers)
    ]


@dataclass
class ChunkPlan:
    """One chunk of one request as this rank sees it."""

    start: int  # c0
    end: int  # c1
    positions: list[list[int]]  # absolute positions owned by each rank (ascending)
    ctx_slots: torch.Tensor  # [c1] slots of positions [0, c1) in this instance's pool

    @property
    def counts(self) -> list[int]:
        return [len(p) for p in self.positions]

    def order(self) -> torch.Tensor:
        """Index that turns rank-major gathered rows into position order (on ctx_slots' device)."""
        flat = torch.tensor(
            [p for ps in self.positions for p in ps], dtype=torch.int64, device=self.ctx_slots.device
        )
        return torch.argsort(flat)


class CPBackend:
    def __init__(
        self, cfg: ModelConfig, pool: KVPool, rank: int, cp_size: int, query_block: int = 256, ops=None
    ):
        self.cfg, self.pool, self.rank, self.cp_size, self.query_block = cfg, pool, rank, cp_size, query_block
        self.ops = ops or TorchOps()  # engine/attn_ops.py
        self.device = pool.kv.device
        self.owners = layer_owners(cfg.num_layers, cp_size)
        self.layer_split = pool.layers != list(range(cfg.num_layers))
        self.plan: ChunkPlan | None = None
        # seconds this rank spent in the CP collectives (all-gathers, waits on broadcasts): the
        # prefill's communication share (bench/prefill_cp.py); host time, so on CUDA it counts launches
        self.comm_s = 0.0
        # called with a layer once this rank stored the chunk's entries of it (a streamed hand-off)
        self.on_stored: Callable[[int], None] | None = None

    def begin(self, plan: ChunkPlan) -> None:
        self.plan = plan
        self._order = plan.order()
        self._my_pos = torch.tensor(plan.positions[self.rank], dtype=torch.int64, device=self.device)
        self._selection: torch.Tensor | None = None
        self._pending: dict[int, tuple[torch.Tensor, object]] = {}  # layer -> (buffer, async work)

    # ---- the AttentionBackend method ------------------------------------------------------
    def attention(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, index: IndexerInputs | None, scale: float
    ) -> torch.Tensor:
        plan = self.plan
        # Every rank issues the same broadcasts in the same order (the owner is the source):
        # this layer's (unless already started), then the next layer's, to overlap with this one.
        self._prefetch(layer)
        self._prefetch(layer + 1)
        t0 = time.perf_counter()
        chunk_kv = all_gather_rows(kv, plan.counts)[self._order]  # [c1 - c0, c + rope] in position order
        chunk_idx = all_gather_rows(index.k, plan.counts)[self._order] if index is not None else None
        self.comm_s += time.perf_counter() - t0
        keys, idx_keys = self._context(layer, chunk_kv, chunk_idx)
        out, sel = prefill_attention(
            self.cfg,
            keys,
            idx_keys,
            q,
            self._my_pos,
            index,
            self._selection,
            scale,
            self.query_block,
            self.ops,
        )
        if index is not None:
            self._selection = sel  # shared layers that follow reuse it
        if layer in self._pending and self.pool.holds(layer):
            self._wait(layer)  # our own broadcast: release its buffer once sent
        return out

    # ---- storage ----------------------------------------------------------------------------
    def _context(self, layer: int, chunk_kv: torch.Tensor, chunk_idx: torch.Tensor | None):
        """Stores the chunk's entries and returns this layer's context [c1, ...] (kv, index keys)."""
        plan = self.plan
        new_slots = plan.ctx_slots[plan.start : plan.end]
        if self.pool.holds(layer):
            self.pool.write(layer, new_slots, chunk_kv, chunk_idx)
            if self.on_stored is not None:
                self.on_stored(layer)
            idx = self.pool.read_index(layer, plan.ctx_slots) if chunk_idx is not None else None
            return self.pool.read_kv(layer, plan.ctx_slots), idx
        if plan.start == 0:
            return chunk_kv, chunk_idx
        earlier = self._wait(layer)  # [c0, c + rope (+ Di)] from the owner
        kv_dim = self.cfg.kv_entry_dim
        keys = torch.cat([earlier[:, :kv_dim], chunk_kv])
        idx = torch.cat([earlier[:, kv_dim:], chunk_idx]) if chunk_idx is not None else None
        return keys, idx

    def _prefetch(self, layer: int) -> None:
        """Starts the broadcast of a layer's earlier entries from its owner (layer-split, c0 > 0)."""
        plan = self.plan
        if not self.layer_split or plan.start == 0 or layer >= self.cfg.num_layers or layer in self._pending:
            return
        owner = self.owners[layer]
        width = self.cfg.kv_entry_dim + (self.cfg.index_head_dim if self.cfg.has_indexer(layer) else 0)
        if self.rank == owner:
            slots = plan.ctx_slots[: plan.start]
            parts = [self.pool.read_kv(layer, slots)]
            if self.cfg.has_indexer(layer):
                parts.append(self.pool.read_index(layer, slots))
            buf = torch.cat(parts, dim=1).contiguous()
        else:
            buf = torch.empty(plan.start, width, dtype=self.pool.dtype, device=self.device)
        self._pending[layer] = (buf, dist.broadcast(buf, src=owner, async_op=True))

    def _wait(self, layer: int) -> torch.Tensor:
        buf, work = self._pending.pop(layer)
        t0 = time.perf_counter()
        work.wait()
        self.comm_s += time.perf_counter() - t0
        return buf

    def finish(self) -> None:
        """After a chunk: every broadcast it started has been waited on."""
        assert not self._pending, f"broadcasts still pending for layers {sorted(self._pending)}"
