"""x W^T for a weight kept in fp8 with its block scales (the checkpoint's `weight_scale_inv`).

Three implementations, named by engine/gemm_ops.py (`--linear-ops`):
  torch      model/moe_ops.dequant_linear: the weight dequantized 128 output rows at a time, in
             float32 (float64 for a float64 x), so no whole high-precision copy of it ever exists;
             exact in float64 against dequantize-then-multiply
  triton     model/triton_gemm: up to W8A16_MAX_ROWS rows the fp8 weight is converted in
             registers and multiplied with the bf16 activations (w8a16, split-K: no quantization
             kernels); above that the activations are quantized per row and 128 columns (w8a8)
  scaled_mm  torch's block-scaled scaled_mm for SCALED_MM_MIN_ROWS rows or more (prefill), where
             cuBLAS takes the shape (triton_gemm.scaled_mm_linear), the triton GEMM otherwise
"""

from __future__ import annotations

import torch

from .moe_ops import dequant_linear
from .quant import FP8_BLOCK

SCALED_MM_MIN_ROWS = 64  # below this scaled_mm is slower than bf16 on an H200 (issue 39): triton
W8A16_MAX_ROWS = 4  # few rows: no activation quantization kernels (as triton_moe.PER_PAIR_MAX)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    ops: str,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """x [..., K] times fp8 weight [N, K] with scale [ceil(N/b0), ceil(K/b1)] -> [..., N] in x's dtype."""
    if scale is None:
        raise ValueError("an fp8 weight needs its weight_scale_inv")
    lead, (n, k) = x.shape[:-1], weight.shape
    x2 = x.reshape(-1, k)
    if ops == "torch":
        y = dequant_linear(x2, weight, scale, block, bias)
    else:
        from .triton_gemm import fp8_linear, fp8_linear_w8a16, scaled_mm_linear  # imported where it runs

        rows = x2.shape[0]
        if ops == "scaled_mm" and rows >= SCALED_MM_MIN_ROWS:
            y = scaled_mm_linear(x2, weight, scale)  # the triton GEMM where cuBLAS cannot take the shape
        elif rows <= W8A16_MAX_ROWS:  # streaming the weight: bf16 activations, no quantization kernels
            y = fp8_linear_w8a16(x2, weight, scale)
        else:
            y = fp8_linear(x2, weight, scale)
        if bias is not None:
            y = y + bias
    return y.reshape(*lead, n)
