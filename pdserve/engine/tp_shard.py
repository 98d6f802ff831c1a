"""Tensor-parallel weight slicing applied from outside the model (gpt-fast tp.py style).

Both servers split MLP/MoE weights by their intermediate dimension: gate/up by rows (column
parallel), down by columns (row parallel); every rank's partial outputs sum to the full output.
Splits may be uneven (intermediate % world != 0): rank r takes [r*n//world, (r+1)*n//world).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.fusion import fuse_projections
from ..model.layers import MLP, MoE


def span(size: int, rank: int, world: int) -> slice:
    return slice(rank * size // world, (rank + 1) * size // world)


def keep(param: nn.Parameter, value: torch.Tensor) -> None:
    """Replaces a parameter's storage with a fresh copy of `value`, so the full weight is freed."""
    param.data = value.contiguous().clone()


def shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    cols = span(mlp.gate_proj.weight.shape[0], rank, world)
    keep(mlp.gate_proj.weight, mlp.gate_proj.weight[cols])
    keep(mlp.up_proj.weight, mlp.up_proj.weight[cols])
    keep(mlp.down_proj.weight, mlp.down_proj.weight[:, cols])
    fuse_projections(mlp)  # keep() replaced gate and up: stack the slices anew


def shard_moe(moe: MoE, rank: int, world: int) -> None:
    """Every routed expert and the shared experts split by intermediate dim; the router is replicated."""
    gate_up = moe.experts.gate_up_proj  # [E, 2I, H]: gate rows, then up rows
    inter = gate_up.shape[1] // 2
    cols = span(inter, rank, world)
    keep(gate_up, torch.cat([gate_up[:, :inter][:, cols], gate_up[:, inter:][:, cols]], dim=1))
    keep(moe.experts.down_proj, moe.experts.down_proj[:, :, cols])
    if moe.shared_experts is not None:
        shard_mlp(moe.shared_experts, rank, world)


def shard_ffn(ffn: nn.Module, rank: int, world: int) -> None:
    if isinstance(ffn, MoE):
        shard_moe(ffn, rank, world)
    else:
        shard_mlp(ffn, rank, world)
