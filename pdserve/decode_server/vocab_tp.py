"""Vocab-parallel embeddings and LM head for a decode instance's W ranks.

Rank r holds rows [r*V//W, (r+1)*V//W) of the embedding and of the LM head (model/shard.py
`cut_rows`, so the loader reads only those). A lookup takes the rows of the ids this rank holds,
zeros for the others, and all-reduces: each id's row comes from exactly one rank and is added to
zeros, so the result is the replicated lookup's, bit for bit. The LM head multiplies the hidden
states by this rank's rows and all-gathers the [B, V/W] parts into [B, V] on every rank (the parts
of an uneven split are padded to one width for the collective and trimmed after): every logit is
the dot product the replicated head computes (model/layers.linear may pick another BLAS path for a
narrower weight: the same value up to the order of its sum). Both are collectives: every rank calls them.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.shard import cut_rows
from ..model.transformer import CausalLM, Embedding
from ..runtime.tp_shard import span


def shard_vocab(model: CausalLM, rank: int, world: int) -> None:
    """This rank's rows of the embedding and the LM head (a tied head keeps the embedding's)."""
    vocab = model.config.vocab_size
    emb = model.model.embed_tokens
    cut_rows(emb, span(vocab, rank, world))
    if model.config.tie_word_embeddings:
        model.lm_head.weight, model.lm_head.cut = emb.weight, emb.cut
    else:
        cut_rows(model.lm_head, span(vocab, rank, world))


class VocabParallelEmbedding(Embedding):
    """An embedding of which this rank holds rows `rows`; the lookup is summed over `comm`."""

    def __init__(self, inner: Embedding, rows: slice, comm):
        nn.Module.__init__(self)
        self.weight, self.cut, self.comm = inner.weight, inner.cut, comm
        self.start, self.size = rows.start, rows.stop - rows.start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        held = (local >= 0) & (local < self.size)
        rows = nn.functional.embedding(local.clamp(0, self.size - 1), self.weight)
        return self.comm.all_reduce(torch.where(held[:, None], rows, torch.zeros_like(rows)))


class VocabParallelHead(Embedding):
    """An LM head of which each rank holds a slice of rows; `logits` gathers the full [B, vocab]."""

    def __init__(self, inner: Embedding, vocab: int, world: int, comm):
        nn.Module.__init__(self)
        self.weight, self.cut, self.comm = inner.weight, inner.cut, comm
        self.sizes = [span(vocab, r, world).stop - span(vocab, r, world).start for r in range(world)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        part = super().logits(hidden)  # [B, this rank's rows]
        width = max(self.sizes)
        parts = self.comm.all_gather(nn.functional.pad(part, (0, width - part.shape[1])))  # [W, B, width]
        return torch.cat([parts[r, :, :n] for r, n in enumerate(self.sizes)], dim=1)


def wrap_vocab(model: CausalLM, rank: int, world: int, comm) -> None:
    """The collectives of a loaded vocab-parallel model (the weights stay where they are)."""
    vocab = model.config.vocab_size
    model.model.embed_tokens = VocabParallelEmbedding(
        model.model.embed_tokens, span(vocab, rank, world), comm
    )
    model.lm_head = VocabParallelHead(model.lm_head, vocab, world, comm)
