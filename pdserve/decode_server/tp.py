"""Tensor parallelism for a decode instance, applied from outside the model.

W ranks; rank r owns head slice r (H / W heads). Within a DCP group of C_d consecutive ranks the
group's head slices are those of its members. Each rank keeps:
  - the query projection (and W_UK) for its own slice, or with --replicate-q-proj for every head
    slice of its group, so it can compute the whole group's queries without an all-gather;
  - W_UV and the o_proj columns of its own slice; o_proj's output is all-reduced over the W ranks;
  - 1/W of every MLP / expert (intermediate dim), all-reduced after the block; with --moe-ep the
    routed experts are split by id instead (E/W whole experts per rank, runtime/expert_parallel.py):
    every rank holds every token of the step, so no token is exchanged and the same all-reduce
    sums the ranks' experts (the shared expert and dense MLPs stay cut by intermediate dim);
  - 1/W of the vocabulary's rows of the embedding and of the LM head (vocab_tp.py);
  - replicated: norms, kv_a projection, the indexer, the router.

`shard_decode_model` gives a (meta) model this rank's shapes, so the loader allocates and reads only
them; `wrap_decode_tp` then adds the all-reduces; `apply_decode_tp` does both to a loaded model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.attention import MLAttention
from ..model.shard import cut_linear
from ..model.transformer import CausalLM
from ..runtime.expert_parallel import shard_moe_ep
from ..runtime.tp_shard import shard_ffn
from .vocab_tp import shard_vocab, wrap_vocab


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


def _head_rows(weight: torch.Tensor, num_heads: int, heads: range) -> slice:
    """The rows of a [heads * per_head, in] weight that hold `heads` (consecutive)."""
    per_head = weight.shape[0] // num_heads
    return slice(heads.start * per_head, heads.stop * per_head)


def shard_attention(attn: MLAttention, rank: int, world: int, dcp: int, replicate_q: bool) -> None:
    H = attn.n_heads
    own, group = head_slices(H, rank, world, dcp)
    q_heads = group if replicate_q else own
    q_lin = attn.q_proj if hasattr(attn, "q_proj") else attn.q_b_proj
    cut_linear(q_lin, 0, _head_rows(q_lin.weight, H, q_heads))
    cut_linear(attn.kv_b_proj, 0, _head_rows(attn.kv_b_proj.weight, H, q_heads))
    v = attn.v_dim
    cut_linear(attn.o_proj, 1, slice(own.start * v, own.stop * v))
    attn.n_heads = len(q_heads)
    attn.out_heads = slice(own.start - q_heads.start, own.stop - q_heads.start)


def shard_decode_model(
    model: CausalLM, rank: int, world: int, dcp: int, replicate_q: bool, moe_ep: bool = False
) -> None:
    """This rank's slices of every layer (shapes only on a meta model; the loader fills them)."""
    if world == 1:
        return
    for layer in model.model.layers:
        shard_attention(layer.self_attn, rank, world, dcp, replicate_q)
    if moe_ep:
        shard_moe_ep(model, rank, world, shared_tp=True)
    else:
        for layer in model.model.layers:
            shard_ffn(layer.mlp, rank, world)
    shard_vocab(model, rank, world)


@torch.no_grad()
def wrap_decode_tp(model: CausalLM, rank: int, world: int, comm) -> None:
    """The all-reduces after o_proj and after each MLP / MoE block and the vocab-parallel embedding
    and LM head's collectives, on a loaded sharded model."""
    if world == 1:
        return
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.o_proj.bias is not None and rank != 0:
            attn.o_proj.bias.zero_()  # the bias is added once, by rank 0
        attn.o_proj = AllReduce(attn.o_proj, comm)
        layer.mlp = AllReduce(layer.mlp, comm)
    wrap_vocab(model, rank, world, comm)


def apply_decode_tp(
    model: CausalLM, rank: int, world: int, dcp: int, replicate_q: bool, comm, moe_ep: bool = False
) -> None:
    """Both steps on a loaded (whole) model. comm: collectives over all W ranks (runtime/comm.py)."""
    shard_decode_model(model, rank, world, dcp, replicate_q, moe_ep)
    wrap_decode_tp(model, rank, world, comm)
