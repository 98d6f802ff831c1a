"""Tensor-parallel weight slicing applied from outside the model (gpt-fast tp.py style).

Both servers split MLP/MoE weights by their intermediate dimension: gate/up by rows (column
parallel), down by columns (row parallel); every rank's partial outputs sum to the full output.
Splits may be uneven (intermediate % world != 0): rank r takes [r*n//world, (r+1)*n//world).
Applied to a model on the meta device before loading (model/weights.load_model `shard`), the cuts
give each rank only its shapes and the loader reads only its slices; applied to a loaded model they
slice the real weights.
"""

from __future__ import annotations

from torch import nn

from ..model.fusion import fuse_projections
from ..model.layers import MLP, MoE
from ..model.shard import cut_experts, cut_linear


def span(size: int, rank: int, world: int) -> slice:
    return slice(rank * size // world, (rank + 1) * size // world)


def shard_mlp(mlp: MLP, rank: int, world: int) -> None:
    cols = span(mlp.gate_proj.weight.shape[0], rank, world)
    cut_linear(mlp.gate_proj, 0, cols)
    cut_linear(mlp.up_proj, 0, cols)
    cut_linear(mlp.down_proj, 1, cols)
    if not mlp.gate_proj.weight.is_meta:
        fuse_projections(mlp)  # gate and up were replaced: stack the slices anew


def shard_moe(moe: MoE, rank: int, world: int) -> None:
    """Every routed expert and the shared experts split by intermediate dim; the router is replicated."""
    cut_experts(moe.experts, span(moe.experts.down_proj.shape[2], rank, world))
    if moe.shared_experts is not None:
        shard_mlp(moe.shared_experts, rank, world)


def shard_ffn(ffn: nn.Module, rank: int, world: int) -> None:
    if isinstance(ffn, MoE):
        shard_moe(ffn, rank, world)
    else:
        shard_mlp(ffn, rank, world)
