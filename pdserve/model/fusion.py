"""Stacked projections: products that read the same input computed as one product.

MLA's q_a_proj, kv_a_proj_with_mqa and the indexer's wk all read the layer's normed hidden state;
an MLP's gate_proj and up_proj both read its input. Stacking their weights by rows (as SGLang's
fused_qkv_a_proj_with_mqa and vLLM's MergedColumnParallelLinear do) turns 3 products into 1 and 2
into 1: a decode step pays a fixed cost per product (the call, OpenMP's fork and join, the start of
a cold weight stream), and on a GPU one launch instead of several.

The checkpoint layout and the parameter names do not change: `stack_rows` copies the parts into one
[sum of rows, in] tensor once, after loading (and again after tensor parallelism replaces a part's
weight), and every part's weight and bias become views into it, so the weights exist once. A
module uses its stack only while every part is still such a view (`RowStack.live`); if anything
replaces a part's storage (a TP shard's `keep`, a test), the module falls back to its parts until
`fuse_projections` runs again. Same values up to the order of the sums: each output row is the same
dot product (tests/model/test_fusion.py).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import MLAttention
from .layers import MLP, Linear, linear


class RowStack:
    """The stacked weight [sum(sizes), in] (and bias) of `parts`, whose weights are views into it."""

    def __init__(self, parts: list[Linear]):
        self.parts = parts
        self.sizes = [p.weight.shape[0] for p in parts]
        with torch.no_grad():
            self.weight = torch.cat([p.weight for p in parts])
            has_bias = any(p.bias is not None for p in parts)
            self.bias = (
                torch.cat(
                    [
                        p.bias if p.bias is not None else p.weight.new_zeros(n)
                        for p, n in zip(parts, self.sizes)
                    ]
                )
                if has_bias
                else None
            )
            start = 0
            for p, n in zip(parts, self.sizes):
                p.weight.data = self.weight[start : start + n]
                if p.bias is not None:
                    p.bias.data = self.bias[start : start + n]
                start += n
        self._ptrs = [p.weight.data_ptr() for p in parts]

    def live(self) -> bool:
        """Whether every part's weight is still the view it was given (nothing replaced it)."""
        return all(p.weight.data_ptr() == ptr for p, ptr in zip(self.parts, self._ptrs))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., in] -> one [..., size] output per part (views into one product's output)."""
        return list(linear(x, self.weight, self.bias).split(self.sizes, dim=-1))


def stack_rows(parts: list[Linear]) -> RowStack | None:
    """A RowStack when there are at least two parts of one dtype, device and input size (not fp8:
    their block scales would have to be stacked too, and the parts multiply with their own kernel)."""
    if len(parts) < 2:
        return None
    w0 = parts[0].weight
    if w0.dtype == torch.float8_e4m3fn:
        return None
    if any(
        p.weight.dtype != w0.dtype or p.weight.device != w0.device or p.weight.shape[1] != w0.shape[1]
        for p in parts
    ):
        return None
    if any(p.bias is not None and p.bias.dtype != w0.dtype for p in parts):
        return None
    return RowStack(parts)


def fuse_projections(model: nn.Module) -> None:
    """Stacks, in every attention module and MLP of `model`, the projections that read one input.
    Idempotent: parts whose stack is still live are left alone, others are stacked anew."""
    for module in model.modules():
        if isinstance(module, MLAttention):
            if module.a_stack is None or not module.a_stack.live():
                module.a_stack = stack_rows(module.input_projections())
        elif isinstance(module, MLP):
            if module.gate_up is None or not module.gate_up.live():
                module.gate_up = stack_rows([module.gate_proj, module.up_proj])
