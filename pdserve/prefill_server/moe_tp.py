"""MLP/MoE across the prefill ranks (`--moe-tp`, article section 2.1), applied from outside the model.

Attention is split by token, the MLP by weight: before each MLP/MoE block the ranks all-gather
their tokens, every rank applies its column slice of gate/up and the matching row slice of down
(for the dense MLP, every routed expert and the shared experts) to all tokens, and a
reduce-scatter sums the partial outputs and hands each rank back its own tokens. Each rank then
holds about 1/C of the MLP weights. The router is replicated, so every rank routes identically.

With --moe-ep as well the routed experts are split by id instead (runtime/expert_parallel.py): the
block already sees every token, so no token is exchanged and the reduce-scatter sums the ranks'
experts. --moe-ep alone exchanges tokens by all-to-all (ExpertParallelMoE).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.transformer import CausalLM
from ..runtime.collectives import all_gather_rows, reduce_scatter_rows
from ..runtime.expert_parallel import shard_moe_ep
from ..runtime.tp_shard import shard_ffn


class TokenSplit:
    """How many tokens each rank holds in the current forward; set by the worker per chunk."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.counts = [0] * world


class TensorParallelMLP(nn.Module):
    def __init__(self, inner: nn.Module, split: TokenSplit):
        super().__init__()
        self.inner, self.split = inner, split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = self.split.counts
        every = all_gather_rows(x, counts)  # [sum(counts), hidden]
        partial = self.inner(every)  # this rank's slice of every token's output
        return reduce_scatter_rows(partial, counts, self.split.rank)


def shard_moe_tp(model: CausalLM, rank: int, world: int) -> None:
    """This rank's slice of every MLP / MoE block (shapes only on a meta model; the loader fills them)."""
    for layer in model.model.layers:
        shard_ffn(layer.mlp, rank, world)


def shard_prefill_ffn(model: CausalLM, rank: int, world: int, moe_tp: bool, moe_ep: bool) -> None:
    """A prefill rank's MLP / MoE weights: --moe-tp cuts them by intermediate dim, --moe-ep the routed
    experts by id (with --moe-tp the shared expert and dense MLPs still by intermediate dim, else
    whole); neither: every rank holds them all."""
    if moe_ep:
        shard_moe_ep(model, rank, world, shared_tp=moe_tp)
    elif moe_tp:
        shard_moe_tp(model, rank, world)


def wrap_moe_tp(model: CausalLM, split: TokenSplit) -> None:
    for layer in model.model.layers:
        layer.mlp = TensorParallelMLP(layer.mlp, split)


def apply_moe_tp(model: CausalLM, split: TokenSplit) -> None:
    """Both steps on a loaded (whole) model."""
    shard_moe_tp(model, split.rank, split.world)
    wrap_moe_tp(model, split)
