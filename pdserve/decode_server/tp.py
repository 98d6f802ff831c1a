"""Tensor parallelism for a decode instance, applied from outside the model.

W ranks; rank r owns head slice r (H / W heads). Within a DCP group of C_d consecutive ranks the
group's head slices are those of its members. Each rank keeps:
  - the query projection (and W_UK) for its own slice, or with --replicate-q-proj for every head
    slice of its group, so it can compute the whole group's queries without an all-gather;
  - W_UV and the o_proj columns of its own slice; o_proj's output is all-reduced over the W ranks;
  - 1/W of every MLP / expert (intermediate dim), all-reduced after the block;
  - replicated: embeddings, norms, kv_a projection, the indexer, the router, the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.tp_shard import keep, shard_ffn
from ..model.attention import MLAttention
from ..model.transformer import CausalLM


class AllReduce(nn.Module):
    """Runs `inner` on this rank's weight slice and sums the partial outputs over the ranks of `comm`."""

    def __init__(self, inner: nn.Module, comm):
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x).contiguous())


def head_slices(num_heads: int, rank: int, world: int, dcp: int) -> tuple[range, range]:
    """(this rank's heads, its DCP group's heads)."""
    if num_heads % world:
        raise ValueError(f"{num_heads} attention heads cannot be split over --tp-size {world}")
    per = num_heads // world
    group = rank // dcp
    return range(rank * per, (rank + 1) * per), range(group * dcp * per, (group + 1) * dcp * per)


def _rows_for_heads(weight: torch.Tensor, num_heads: int, heads: range) -> torch.Tensor:
    per_head = weight.shape[0] // num_heads
    return weight.view(num_heads, per_head, -1)[heads.start : heads.stop].reshape(len(heads) * per_head, -1)


def shard_attention(attn: MLAttention, rank: int, world: int, dcp: int, replicate_q: bool, comm) -> None:
    H = attn.n_heads
    own, group = head_slices(H, rank, world, dcp)
    q_heads = group if replicate_q else own
    q_lin = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
    keep(q_lin.weight, _rows_for_heads(q_lin.weight, H, q_heads))
    keep(attn.kv_b_proj.weight, _rows_for_heads(attn.kv_b_proj.weight, H, q_heads))
    v = attn.v_dim
    keep(attn.o_proj.weight, attn.o_proj.weight[:, own.start * v : own.stop * v])
    if attn.o_proj.bias is not None and rank != 0:
        keep(attn.o_proj.bias, torch.zeros_like(attn.o_proj.bias))  # the bias is added once, by rank 0
    attn.n_heads = len(q_heads)
    attn.out_heads = slice(own.start - q_heads.start, own.stop - q_heads.start)
    attn.o_proj = AllReduce(attn.o_proj, comm)


def apply_decode_tp(model: CausalLM, rank: int, world: int, dcp: int, replicate_q: bool, comm) -> None:
    """comm: collectives over all W ranks (engine/comm.py)."""
    if world == 1:
        return
    for layer in model.model.layers:
        shard_attention(layer.self_attn, rank, world, dcp, replicate_q, comm)
        shard_ffn(layer.mlp, rank, world)
        layer.mlp = AllReduce(layer.mlp, comm)
