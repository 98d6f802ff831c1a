"""Decode context-parallel attention backend (article sections 3-4).

Inside a DCP group of C_d ranks, global slot s lives on group rank s % C_d at row s // C_d; pages
are C_d-wide and C_d-aligned, so a request's token p is on group rank p % C_d. One decode step
(one new token per request) in each attention layer:
  1. the new token's latent entry is written by the rank that owns its slot; its index key by
     every rank (copied index) or by the owner (split index); the other ranks write it into their
     pool's scratch row, as padding rows do (no boolean mask: the step never syncs with the host,
     decode_server/step_metadata.py);
  2. every rank gets the queries of all head slices of its group (all-gather, or computed locally
     with a replicated query projection);
  3. sparse models select keys: with a copied index every rank scores every token and computes
     the same top-k; with a split index each rank scores its own tokens, proposes its best k, one
     all-gather exchanges the candidates and all agree on the global top-k (ties: earlier token);
  4. each rank attends over its own selected rows for every head slice of the group, giving
     (out, lse); a rank that selected nothing has lse = -inf and contributes exactly zero;
  5. the exact merge: `a2a` (one all-to-all carrying outputs and LSEs together, merged by the head
     slice's owner) or `ag_rs` (all-gather of LSEs, reduce-scatter of rescaled outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..choices import DcpComm, DcpIndex, values
from ..engine.attn_ops import TorchOps, attend_cached, cached_index_scores
from ..model.backend import IndexerInputs
from ..model.config import ModelConfig
from .step_metadata import derive_slots

INDEX_MODES = values(DcpIndex)
COMM_MODES = values(DcpComm)


@dataclass
class DecodeBatch:
    """A step's requests as device tensors (decode_server/step_metadata.py)."""

    page_table: torch.Tensor  # [B, W] int: each request's pages (0 past its last one)
    lengths: torch.Tensor  # [B] int: context length S, positions 0..S-1 read; 0: a padding row
    page_size: int


@dataclass(frozen=True)
class DCPGroup:
    rank: int  # rank within the group (= slot % C_d it owns)
    size: int  # C_d
    comm: object  # collectives of its members (runtime/comm.py)


class DCPBackend:
    def __init__(
        self, cfg: ModelConfig, pool, dcp: DCPGroup, index_mode: str, comm: str, replicate_q: bool, ops=None
    ):
        if index_mode not in INDEX_MODES or comm not in COMM_MODES:
            raise ValueError(
                f"index mode {index_mode!r} / comm {comm!r} (allowed: {INDEX_MODES}, {COMM_MODES})"
            )
        self.cfg, self.pool, self.dcp = cfg, pool, dcp
        self.ops = ops or TorchOps()  # engine/attn_ops.py
        self.device = pool.kv.device
        self.index_mode, self.comm, self.replicate_q = index_mode, comm, replicate_q
        if pool.scratch_row is None:
            raise ValueError("a decode pool needs its scratch row (KVPool(scratch=True))")
        self._empty = torch.zeros((), dtype=torch.int64, device=self.device)  # see empty_selections
        self.selections: dict[int, torch.Tensor] = {}

    def begin(self, batch: DecodeBatch) -> None:
        """The step's slots, masks and write rows, derived on the device (no host sync)."""
        C, me = self.dcp.size, self.dcp.rank
        self._slots, self._valid = derive_slots(batch.page_table, batch.lengths, batch.page_size)  # [B, S]
        B, S = self._slots.shape  # S = W * page_size, a multiple of C: every rank owns S / C positions
        own_pos = torch.arange(me, S, C, device=self.device)
        self._own_pos = own_pos.expand(B, -1)  # [B, N]
        self._own_valid = self._valid[:, own_pos]
        self._own_rows = self._slots[:, own_pos] // C
        lengths = batch.lengths.long()
        self._live = lengths > 0  # [B]: not a padding row
        last = (lengths - 1).clamp(min=0)
        new_slots = self._slots.gather(1, last[:, None]).squeeze(1)  # [B]
        mine = self._live & (last % C == me)
        # rows this rank does not keep write the pool's scratch row: every row writes, none is masked out
        self._new_rows = torch.where(mine, new_slots // C, self.pool.scratch_row)
        if self.index_mode == "copy":
            self._new_index = torch.where(self._live, new_slots, self.pool.scratch_index)
        else:
            self._new_index = torch.where(mine, new_slots // C, self.pool.scratch_index)
        self._selection: torch.Tensor | None = None
        self.selections: dict[int, torch.Tensor] = {}  # indexer layer -> [B, k]: this step's (for checks)

    @property
    def empty_selections(self) -> int:
        """(request, layer) pairs where this rank selected no token: read on the host between steps."""
        return int(self._empty)

    # ---- the AttentionBackend method ------------------------------------------------------
    def attention(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, index: IndexerInputs | None, scale: float
    ) -> torch.Tensor:
        self._store(layer, kv, index)
        q_group = q if (self.replicate_q or self.dcp.size == 1) else self._gather_heads(q)  # [B, Hg, D]
        rows, valid = self._keys(layer, index)
        self._empty += ((valid.sum(-1) == 0) & self._live).sum()  # a device counter: no host read
        out, lse = attend_cached(  # [B, Hg, c], [B, Hg]
            self.ops, self.pool, layer, q_group, rows, valid, scale, self.cfg.kv_lora_rank
        )
        if self.dcp.size == 1:
            return out
        merged = self._merge_a2a(out, lse) if self.comm == "a2a" else self._merge_ag_rs(out, lse)
        return merged.to(q.dtype)

    # ---- cache -------------------------------------------------------------------------------
    def _store(self, layer: int, kv: torch.Tensor, index: IndexerInputs | None) -> None:
        self.pool.write_kv(layer, self._new_rows, kv)
        if index is not None:
            self.pool.write_index(layer, self._new_index, index.k)

    def _keys(self, layer: int, index: IndexerInputs | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's pool slots of each request's keys [B, n] and which of them are read [B, n]."""
        if not self.cfg.is_sparse:
            return self._own_rows, self._own_valid
        if index is not None:
            self._selection = (
                self._select_copy(layer, index)
                if self.index_mode == "copy"
                else self._select_split(layer, index)
            )
            self.selections[layer] = self._selection
        sel = self._selection  # [B, k] global positions, -1 padded; shared layers reuse it
        mine = (sel >= 0) & (sel % self.dcp.size == self.dcp.rank)
        return self._slots.gather(1, sel.clamp(min=0)) // self.dcp.size, mine

    def _select_copy(self, layer: int, index: IndexerInputs) -> torch.Tensor:
        scores = cached_index_scores(self.pool, layer, self._slots, index)  # [B, Smax]: every token
        return self.ops.topk(scores, self._valid, self.cfg.index_topk)

    def _select_split(self, layer: int, index: IndexerInputs) -> torch.Tensor:
        k = self.cfg.index_topk
        scores = cached_index_scores(self.pool, layer, self._own_rows, index)  # [B, N]: own tokens only
        cand_score, cand_pos = self._candidates(scores, k)
        packed = torch.stack([cand_score.double(), cand_pos.double()], dim=-1)  # [B, k, 2]: one collective
        every = self.dcp.comm.all_gather(packed)  # [C, B, k, 2]
        every = every.permute(1, 0, 2, 3).reshape(packed.shape[0], -1, 2)  # [B, C*k, 2]
        pos = every[..., 1].long()
        order = torch.where(pos >= 0, pos, torch.full_like(pos, 1 << 62)).argsort(dim=-1)  # by position
        pos = pos.gather(1, order)
        score = every[..., 0].gather(1, order).to(scores.dtype)
        pick = self.ops.topk(score, pos >= 0, k)  # ties: the earlier position comes first in this order
        return torch.where(pick >= 0, pos.gather(1, pick.clamp(min=0)), torch.full_like(pick, -1))

    def _candidates(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's best k (score, global position) per request [B, k], padded with (-inf, -1);
        all padding when the rank owns no valid position yet."""
        local = self.ops.topk(scores, self._own_valid, k)  # [B, k] indices into own tokens
        ok, at = local >= 0, local.clamp(min=0)
        cand_score = torch.where(ok, scores.gather(1, at), torch.full_like(scores[:, :1], float("-inf")))
        cand_pos = torch.where(ok, self._own_pos.gather(1, at), torch.full_like(local, -1))
        return cand_score, cand_pos

    # ---- head slices and the merge -------------------------------------------------------------
    def _gather_heads(self, q: torch.Tensor) -> torch.Tensor:
        C = self.dcp.size
        every = self.dcp.comm.all_gather(q)  # [C, B, Hl, D]
        return every.permute(1, 0, 2, 3).reshape(q.shape[0], C * q.shape[1], q.shape[2])  # [B, Hg, D]

    def _merge_a2a(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        C, (B, Hg, c) = self.dcp.size, out.shape
        packed = torch.cat([out.to(lse.dtype), lse.unsqueeze(-1)], dim=-1)  # [B, Hg, c + 1]
        send = packed.view(B, C, Hg // C, c + 1).permute(1, 0, 2, 3).contiguous()  # [C, B, Hl, c + 1]
        recv = self.dcp.comm.all_to_all(send)  # recv[j]: group rank j's part of my slice
        merged, _ = self.ops.merge(recv[..., :c], recv[..., c])
        return merged

    def _merge_ag_rs(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        C, (B, Hg, c) = self.dcp.size, out.shape
        lses = self.dcp.comm.all_gather(lse)  # [C, B, Hg]
        total = torch.logsumexp(lses, dim=0)
        safe = torch.where(torch.isinf(total), torch.zeros_like(total), total)
        weight = torch.exp(lse - safe)  # exp(-inf) = 0 for a rank that read nothing
        scaled = out.to(lse.dtype) * weight.unsqueeze(-1)
        send = scaled.view(B, C, Hg // C, c).permute(1, 0, 2, 3)  # [C, B, Hl, c]: part j for group rank j
        return self.dcp.comm.reduce_scatter(send)  # the sum of every rank's part of my slice
