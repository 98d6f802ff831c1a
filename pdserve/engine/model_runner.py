"""Executes what the scheduler decided: builds the flattened batch, runs the model, returns logits."""

from __future__ import annotations

import torch

from ..kvcache.page_allocator import PageAllocator
from ..model.transformer import CausalLM
from .scheduler import Chunk
from .single_backend import ForwardBatch, SeqChunk, SingleRankBackend


class ModelRunner:
    def __init__(self, model: CausalLM, allocator: PageAllocator, backend: SingleRankBackend):
        self.model, self.allocator, self.backend = model, allocator, backend
        self.device = next(model.parameters()).device  # every tensor built here goes there

    def _slots(self, pages: list[int], end: int) -> torch.Tensor:
        """Slots of positions [0, end) for a request that owns `pages`."""
        ps = self.allocator.page_size
        pos = torch.arange(end, device=self.device)
        return torch.tensor(pages, dtype=torch.int64, device=self.device)[pos // ps] * ps + pos % ps

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], all_logits: bool = False) -> torch.Tensor:
        """Returns logits [len(chunks), V] for each chunk's last position ([T, V] if all_logits)."""
        ids, positions, new_slots, seqs = [], [], [], []
        offset = 0
        for c in chunks:
            req = c.request
            ctx = self._slots(req.pages, c.start + c.n)  # [S]
            ids.append(
                torch.tensor(req.all_ids[c.start : c.start + c.n], dtype=torch.int64, device=self.device)
            )
            positions.append(torch.arange(c.start, c.start + c.n, device=self.device))
            new_slots.append(ctx[c.start :])
            seqs.append(SeqChunk(ctx_slots=ctx, start=c.start, n=c.n, offset=offset))
            offset += c.n
        self.backend.begin(ForwardBatch(seqs=seqs, new_slots=torch.cat(new_slots)))
        hidden = self.model(torch.cat(ids), torch.cat(positions), self.backend)  # [T, hidden]
        if not all_logits:
            hidden = hidden[torch.tensor([s.offset + s.n - 1 for s in seqs], device=self.device)]
        return self.model.compute_logits(hidden)
