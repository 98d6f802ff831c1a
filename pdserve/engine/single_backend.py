"""Single-rank attention backend: the whole cache on one device, addressed through pages.

For each forward the runner describes the batch (which flattened tokens belong to which request,
at which positions, and the slots of every request's context). In each layer the backend writes
the new latent entries (and index keys), picks the keys each query reads, and runs the kernel:
  - a request with several new tokens (prefill, chunked or not) is processed in query blocks of
    `query_block` tokens, so memory grows with block x context, never context x context;
  - requests with one new token (decode) are batched together over a padded context.
Sparse-attention models select keys with the indexer's top-k (tie rule: earlier token wins);
`shared` layers reuse the selection of the previous full layer from the same forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvcache.kv_cache import KVPool
from ..model.backend import IndexerInputs
from ..model.config import ModelConfig
from .attn_ops import TorchOps, attend_cached, cached_index_scores
from .prefill_attention import prefill_attention


@dataclass
class SeqChunk:
    ctx_slots: torch.Tensor  # [S] slots of positions 0..S-1, where S = start + n
    start: int  # position of the first new token
    n: int  # new tokens in this forward
    offset: int  # index of the first new token in the flattened batch


@dataclass
class ForwardBatch:
    seqs: list[SeqChunk]
    new_slots: torch.Tensor  # [T] where each new token's entry is written

    @property
    def num_tokens(self) -> int:
        return int(self.new_slots.numel())


class SingleRankBackend:
    def __init__(self, cfg: ModelConfig, pool: KVPool, query_block: int = 256, ops=None):
        self.cfg, self.pool, self.query_block = cfg, pool, query_block
        self.ops = ops or TorchOps()  # engine/attn_ops.py
        self.device = pool.kv.device
        self.batch: ForwardBatch | None = None

    def begin(self, batch: ForwardBatch) -> None:
        """Called by the runner before each forward."""
        self.batch = batch
        self._selection: dict[int, torch.Tensor] = {}  # prefill seq index -> [n, k]
        self.decode_selection: torch.Tensor | None = None  # decode group: positions [B, k] (-1: none)
        self._decode_pick: tuple[torch.Tensor, torch.Tensor] | None = None  # their slots, valid
        self._multi = [i for i, s in enumerate(batch.seqs) if s.n > 1]
        single = [i for i, s in enumerate(batch.seqs) if s.n == 1]
        self._single = single
        if single:
            lens = [batch.seqs[i].ctx_slots.numel() for i in single]
            smax = max(lens)
            dev = self.device
            self._dec_slots = torch.zeros(
                len(single), smax, dtype=torch.int64, device=dev
            )  # [B, Smax], 0-padded
            for row, i in enumerate(single):
                self._dec_slots[row, : lens[row]] = batch.seqs[i].ctx_slots
            lens_t = torch.tensor(lens, device=dev)
            self._dec_valid = torch.arange(smax, device=dev)[None, :] < lens_t[:, None]  # [B, Smax]
            self._dec_rows = torch.tensor([batch.seqs[i].offset for i in single], device=dev)

    def attention(
        self, layer: int, q: torch.Tensor, kv: torch.Tensor, index: IndexerInputs | None, scale: float
    ) -> torch.Tensor:
        batch = self.batch
        self.pool.write(layer, batch.new_slots, kv, index.k if index is not None else None)
        if not self._multi:  # a decode-only batch: its rows are the decode group's, in order
            return self._decode(layer, q, index, scale)
        out = q.new_empty(q.shape[0], q.shape[1], self.cfg.kv_lora_rank)  # [T, H, c]
        for i in self._multi:
            s = batch.seqs[i]
            rows = slice(s.offset, s.offset + s.n)
            out[rows] = self._prefill_seq(layer, i, s, q[rows], _rows(index, rows), scale)
        if self._single:
            out[self._dec_rows] = self._decode(layer, q[self._dec_rows], _rows(index, self._dec_rows), scale)
        return out

    def _prefill_seq(
        self, layer: int, key: int, s: SeqChunk, q: torch.Tensor, index: IndexerInputs | None, scale: float
    ) -> torch.Tensor:
        keys = self.pool.read_kv(layer, s.ctx_slots)  # [S, c + rope]
        idx_keys = self.pool.read_index(layer, s.ctx_slots) if index is not None else None  # [S, Di]
        q_pos = torch.arange(s.start, s.start + s.n, device=self.device)
        out, sel = prefill_attention(
            self.cfg,
            keys,
            idx_keys,
            q,
            q_pos,
            index,
            self._selection.get(key),
            scale,
            self.query_block,
            self.ops,
        )
        if index is not None:
            self._selection[key] = sel
        return out

    def _decode(self, layer: int, q: torch.Tensor, index: IndexerInputs | None, scale: float) -> torch.Tensor:
        cfg = self.cfg
        slots, valid = self._dec_slots, self._dec_valid
        if not cfg.is_sparse:
            return attend_cached(self.ops, self.pool, layer, q, slots, valid, scale, cfg.kv_lora_rank)[0]
        if index is not None:  # a full layer selects; the shared layers after it reuse the selection
            scores = cached_index_scores(self.pool, layer, slots, index)  # [B, Smax]
            self.decode_selection = sel = self.ops.topk(scores, valid, cfg.index_topk)  # [B, k]
            self._decode_pick = (slots.gather(1, sel.clamp(min=0)), sel >= 0)  # [B, k] slots, valid
        picked, picked_valid = self._decode_pick  # [B, k] slots
        return attend_cached(self.ops, self.pool, layer, q, picked, picked_valid, scale, cfg.kv_lora_rank)[0]


def _rows(index: IndexerInputs | None, rows) -> IndexerInputs | None:
    if index is None:
        return None
    return IndexerInputs(index.q[rows], index.k[rows], index.weights[rows], index.softmax_scale)
