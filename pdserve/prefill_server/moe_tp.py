"""MLP/MoE across the prefill ranks (`--moe-tp`, article section 2.1), applied from outside the model.

Attention is split by token, the MLP by weight: before each MLP/MoE block the ranks all-gather
their tokens, every rank applies its column slice of gate/up and the matching row slice of down
(for the dense MLP, every routed expert and the shared experts) to all tokens, and a
reduce-scatter sums the partial outputs and hands each rank back its own tokens. Each rank then
holds about 1/C of the MLP weights. The router is replicated, so every rank routes identically.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.collectives import all_gather_rows, reduce_scatter_rows
from ..model.layers import MLP, MoE
from ..model.transformer import CausalLM


def _span(size: int, rank: int, world: int) -> slice:
    return slice(rank * size // world, (rank + 1) * size // world)


def _keep(param: nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.contiguous().clone()  # a fresh, smaller storage: the full weight is freed


def shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    cols = _span(mlp.gate_proj.weight.shape[0], rank, world)
    _keep(mlp.gate_proj.weight, mlp.gate_proj.weight[cols])
    _keep(mlp.up_proj.weight, mlp.up_proj.weight[cols])
    _keep(mlp.down_proj.weight, mlp.down_proj.weight[:, cols])


def shard_moe(moe: MoE, rank: int, world: int) -> None:
    gate_up = moe.experts.gate_up_proj  # [E, 2I, H]: gate rows, then up rows
    inter = gate_up.shape[1] // 2
    cols = _span(inter, rank, world)
    _keep(gate_up, torch.cat([gate_up[:, :inter][:, cols], gate_up[:, inter:][:, cols]], dim=1))
    _keep(moe.experts.down_proj, moe.experts.down_proj[:, :, cols])
    if moe.shared_experts is not None:
        shard_mlp(moe.shared_experts, rank, world)


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


def apply_moe_tp(model: CausalLM, split: TokenSplit) -> None:
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            shard_moe(layer.mlp, split.rank, split.world)
        else:
            shard_mlp(layer.mlp, split.rank, split.world)
        layer.mlp = TensorParallelMLP(layer.mlp, split)
