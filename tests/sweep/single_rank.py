"""The sweep's oracle: the single-rank engine, continuing a prompt from a given cache.

`SingleRank.expect(ids, steps)` prefills with the single-rank engine (its cache rows in the model
dtype, as a prefill instance sends them), then decodes `steps` greedy tokens one request at a time
through the engine's own runner and backend, over a pool in the decode instance's kv-cache dtype:
with fp8 it reads the same fp8-rounded cache the decode ranks read, so the comparison stays exact.
Each decode step records the positions the indexer selected in every indexer layer (what a copied
index computes: every token's score, top-k with the earlier-token tie rule), and counts the steps
where a tie at score exactly 0 decided the k-th place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Chunk
from pdserve.engine.single_backend import SingleRankBackend
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.kernels import index_scores
from pdserve.request import Request


class RecordingBackend(SingleRankBackend):
    """The single-rank backend, keeping each decode step's selection per indexer layer."""

    def begin(self, batch) -> None:
        super().begin(batch)
        self.selections: dict[int, torch.Tensor] = {}

    def _decode(self, layer, q, index, scale):
        out = super()._decode(layer, q, index, scale)
        if index is not None and self.cfg.is_sparse:
            self.selections[layer] = self.decode_selection.clone()  # [B, k]
            scores = index_scores(
                index.q, index.weights, self.pool.read_index(layer, self._dec_slots), index.softmax_scale
            ).masked_fill(~self._dec_valid, float("nan"))
            self.zero_ties += _zero_ties(scores, self.cfg.index_topk)
        return out


def _zero_ties(scores: torch.Tensor, k: int) -> int:
    """Rows where more tokens score exactly 0 than fit into the top-k after the positive ones."""
    n = 0
    for row in scores:
        row = row[~torch.isnan(row)]
        pos, zero = int((row > 0).sum()), int((row == 0).sum())
        n += int(row.numel() > k and pos < k < pos + zero)
    return n


@dataclass
class Expected:
    tokens: list[int]  # output ids: the first (from the prefill) and one per decode step
    logits: torch.Tensor  # [steps, vocab]
    selections: list[dict[int, torch.Tensor]]  # per decode step: indexer layer -> [k] positions


class SingleRank:
    def __init__(
        self, path: str, dtype: str = "float64", islands: bool = False, kv_cache_dtype: str = "auto"
    ):
        self.prefiller = LLMEngine.from_pretrained(path, dtype, float32_islands=islands, max_kv_tokens=256)
        self.decoder = {}
        for kind in ("auto", "fp8_e4m3"):
            e = LLMEngine(self.prefiller.model, max_kv_tokens=256)
            e.pool = KVPool(
                e.config, e.allocator.num_pages * e.allocator.page_size, e.pool.dtype, kv_cache_dtype=kind
            )
            e.backend = RecordingBackend(e.config, e.pool)
            e.backend.zero_ties = 0
            e.runner = ModelRunner(e.model, e.allocator, e.backend)
            self.decoder[kind] = e

    @property
    def zero_ties(self) -> int:
        return sum(e.backend.zero_ties for e in self.decoder.values())

    def expect(self, ids: list[int], steps: int, kv_cache_dtype: str = "auto") -> Expected:
        logits, kv, index = self.prefiller.prefill_with_cache(ids)
        e = self.decoder[kv_cache_dtype]
        req = Request(list(ids))
        req.output_ids.append(int(logits.argmax()))
        req.pages = e.allocator.allocate(len(ids) + steps)
        try:
            slots = torch.tensor(e.allocator.slots(req.pages, 0, len(ids)))
            for layer in range(e.config.num_layers):
                e.pool.write_kv(layer, slots, kv[layer])
                if layer in index:
                    e.pool.write_index(layer, slots, index[layer])
            rows, sels = [], []
            for _ in range(steps):
                row = e.runner.run([Chunk(req, req.num_tokens - 1, 1)])[0]
                rows.append(row)
                sels.append({layer: s[0] for layer, s in e.backend.selections.items()})
                req.output_ids.append(int(row.argmax()))
        finally:
            e.allocator.free(req.pages)
        empty = torch.empty(0, e.config.vocab_size, dtype=logits.dtype)
        return Expected(req.output_ids, torch.stack(rows) if rows else empty, sels)
