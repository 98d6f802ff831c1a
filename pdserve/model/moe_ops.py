"""Torch references of the routed experts and of a product with an fp8 block-scaled weight.

These are the CPU path and the oracles of the triton kernels (model/triton_moe.py,
model/triton_gemm.py): plain torch, exact in float64, simple rather than fast. They may loop in
Python and synchronise with the device; the kernels may not.

Layouts (the checkpoints', see model/quant.py):
  x            [T, H] in bfloat16, float32 or float64
  w13          [E, 2I, H]: rows 0..I-1 the gate projection, rows I..2I-1 the up projection, so that
               gate, up = (x @ w13[e].T).chunk(2, dim=-1)
  w2           [E, H, I]
  fp8 weights  float8_e4m3fn with float32 block scales (`weight_scale_inv`): w13_scale
               [E, ceil(2I/128), ceil(H/128)], w2_scale [E, ceil(H/128), ceil(I/128)], meaning
               W[e, i, j] = fp8[e, i, j] * scale[e, i // 128, j // 128]; edge blocks may be partial
  topk_ids     [T, k] integers; -1 marks an expert of another rank (expert parallelism): that slot
               adds exactly nothing here
  topk_weights [T, k] routing weights (float32)

    out[t] = sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e].T,  (g, u) = chunk(x[t] @ w13[e].T, 2),
    e = topk_ids[t, j]

Everything is computed in float32 (float64 for a float64 x) and cast to x's dtype at the end; an
fp8 weight is dequantized one expert (or 128 output rows) at a time, so no high-precision copy of a
whole stacked weight ever exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import dequantize_fp8

FP8 = torch.float8_e4m3fn


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the references compute in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weight(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int], work) -> torch.Tensor:
    """One expert's (or one row block's) weight in the work dtype."""
    if w.dtype == FP8:
        if scale is None:
            raise ValueError("an fp8 weight needs its block scales")
        return dequantize_fp8(w, scale, block, work)
    return w.to(work)


def moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """The routed experts of tokens x [T, H] -> [T, H] in x's dtype (module docstring: layouts).

    The (token, slot) pairs are grouped by expert; each expert present multiplies its tokens' rows at
    once, experts in ascending order, and index_add_ sums the weighted results per token."""
    work = work_dtype(x.dtype)
    tokens, hidden = x.shape
    ids = topk_ids.long().flatten()
    k = topk_ids.shape[-1]
    weights = topk_weights.reshape(-1).to(work)
    token_of = torch.arange(tokens, device=x.device).repeat_interleave(k)
    xw = x.to(work)
    out = torch.zeros(tokens, hidden, dtype=work, device=x.device)
    for e in sorted(set(ids.tolist()) - {-1}):
        sel = (ids == e).nonzero().flatten()
        tok = token_of[sel]
        y = _expert(xw[tok], e, w13, w2, w13_scale, w2_scale, block, work)
        out.index_add_(0, tok, y * weights[sel, None])
    return out.to(x.dtype)


def _expert(xw, e: int, w13, w2, w13_scale, w2_scale, block, work) -> torch.Tensor:
    """Expert e's SwiGLU over rows xw [n, H] (in the work dtype) -> [n, H]."""
    s13 = None if w13_scale is None else w13_scale[e]
    s2 = None if w2_scale is None else w2_scale[e]
    gate, up = (xw @ _weight(w13[e], s13, block, work).T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ _weight(w2[e], s2, block, work).T


def moe_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """`moe_torch` without a host sync: every expert multiplies every token, weighted by the token's
    routing weight for it (0 where it did not choose it), experts in ascending order as moe_torch
    adds them -- no shape depends on the routing, so a CUDA graph can hold it. For a decode step's
    few tokens (the decode ranks' torch MoE, Experts.static_shapes): it reads every expert, which a
    decode batch of some tokens reads anyway, and computes E / k times the products."""
    work = work_dtype(x.dtype)
    ids = topk_ids.long()
    weights = topk_weights.to(work)
    xw = x.to(work)
    out = torch.zeros(x.shape, dtype=work, device=x.device)
    for e in range(w13.shape[0]):
        w_e = torch.where(ids == e, weights, torch.zeros_like(weights)).sum(dim=-1)  # [T]
        out += _expert(xw, e, w13, w2, w13_scale, w2_scale, block, work) * w_e[:, None]
    return out.to(x.dtype)


def dequant_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ dequant(w [N, K], scale [ceil(N/b0), ceil(K/b1)]).T (+ bias) -> [M, N] in x's dtype.

    The weight is dequantized block[0] output rows at a time (one row of scales), in float32 (float64
    for a float64 x), so its whole high-precision copy never exists; exact in float64 against
    dequantize-then-multiply."""
    work = work_dtype(x.dtype)
    n = w.shape[0]
    xw = x.to(work)
    y = torch.empty(*x.shape[:-1], n, dtype=work, device=x.device)
    rows = block[0]
    for i in range(-(-n // rows)):
        part = slice(i * rows, (i + 1) * rows)
        y[..., part] = xw @ _weight(w[part], scale[i : i + 1], block, work).T
    if bias is not None:
        y += bias.to(work)
    return y.to(x.dtype)
