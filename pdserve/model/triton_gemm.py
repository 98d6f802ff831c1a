"""x @ W^T for a weight kept in fp8 with 128x128 block scales (the checkpoints' `weight_scale_inv`).

  fp8_linear        w8a8 block-scaled triton GEMM for decode-sized M (1..256): the activations
                    quantized per row and 128 columns (triton_moe.quantize_act), and
                    acc += dot(a_fp8, w_fp8) * a_scale[:, None] * w_scale[None, :] per 128-wide k
                    step, summed in float32
  fp8_linear_w8a16  the same kernel with bf16 activations: the fp8 tile is converted to bf16 in
                    registers (exact) and each k step's dot scaled by the weight scales only
  scaled_mm_linear  large M (prefill): torch's block-scaled scaled_mm (cuBLAS), the triton GEMM when
                    K or N is not a multiple of 128

Layouts: x [M, K] (bf16 on the GPU; float32 for the CPU interpreter tests), w [N, K] float8_e4m3fn,
scale [ceil(N/128), ceil(K/128)] float32 with W[i, j] = w[i, j] * scale[i // 128, j // 128]; the
result is [M, N] in x's dtype. The torch reference is model/moe_ops.dequant_linear.

Split-K. A decode step multiplies a few rows by a weight of N x K: one program per (BLOCK_M x
BLOCK_N) tile of the output gives N / 64 programs (32 for N = 2048, 9 for the kv_a projection's
576), far fewer than the 132 SMs of an H200, and the weight would be read at a fraction of HBM
bandwidth. So when the (M, N) tiles number fewer than 2 x 132, the 128-wide k steps are dealt out to
SPLIT programs per tile (`gemm_config`); each writes its float32 partial into a [SPLIT, M, N] buffer
and the partials are summed by torch in a fixed order: deterministic, no atomics, no semaphores,
and every shape depends only on (M, N, K), so the call is CUDA-graph capturable. No host sync.

Tiles (`gemm_config`, pure function of M, N, K; no autotuning, as in triton_moe.py): BLOCK_K 128
(the scale block; fp8 dots need K >= 32), BLOCK_M 16 / 32 / 64 for M up to 16 / 32 / more (tl.dot's
minimum is 16), BLOCK_N 64 up to 64 rows and 128 beyond, num_stages 4 for the memory-bound few-row
products and 3 otherwise, 4 warps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from .triton_moe import FP8, GROUP, SMS, cdiv, quantize_act

# cuBLAS's block-scaled product wants the scales' K/128 dimension a multiple of 4 (seen on the H200:
# "scale_b must have shape 4 x 48" for K = 256), and a one-row A's scale strides (1, 1): those
# shapes go to the triton GEMM
SCALE_K_MULTIPLE = 4


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    split: int  # programs per output tile along k
    k_blocks_per_split: int  # 128-wide k steps per program (the last one may have fewer)
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, k: int, sms: int = SMS) -> GemmConfig:
    """The tiles and the split-K of an [M, K] x [K, N] product (module docstring: why these)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    kb = max(1, cdiv(k, GROUP))
    split = 1 if tiles >= 2 * sms else max(1, min(kb, cdiv(2 * sms, tiles)))
    per = cdiv(kb, split)
    split = cdiv(kb, per)  # no program without a k step
    few = m <= 64
    return GemmConfig(block_m, block_n, GROUP, 1 if few else 8, split, per, 4, 4 if few else 3)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    """The device's SM count (a cached property query, no sync); SMS off CUDA (the interpreter)."""
    if device.type != "cuda":
        return SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit(do_not_specialize=["M", "k_blocks_per_split"])  # one compile per tile config
def _fp8_gemm_kernel(
    a_ptr,  # [M, K]: fp8 (W8A8) or bf16
    a_scale_ptr,  # [M, ceil(K/128)] float32 (W8A8), else unused
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [ceil(N/128), ceil(K/128)] float32
    out_ptr,  # [SPLIT, M, N] float32 partials, or [M, N] in x's dtype when SPLIT is 1
    M,
    N,
    K,
    k_blocks_per_split,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_wn,
    stride_wk,
    stride_wsn,
    stride_wsk,
    stride_os,
    stride_om,
    stride_on,
    W8A8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    kb_first = split * k_blocks_per_split
    kb_end = tl.minimum(kb_first + k_blocks_per_split, (K + BLOCK_K - 1) // BLOCK_K)

    k0 = kb_first * BLOCK_K
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
    ws_ptrs = w_scale_ptr + (offs_n // 128) * stride_wsn  # BLOCK_K is 128: a k step is a k block
    if W8A8:
        as_ptrs = a_scale_ptr + offs_m * stride_asm

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(kb_first, kb_end):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & n_ok[None, :], other=0.0)
        ws = tl.load(ws_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)
        if W8A8:
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=m_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * ws[None, :]
        else:
            acc += tl.dot(a, w.to(a.dtype)) * ws[None, :]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    out_ptrs = (
        out_ptr + split * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {list(x.shape)} and w {list(w.shape)} are not [M, K] and [N, K]")
    if w.dtype != FP8:
        raise ValueError(f"w must be float8_e4m3fn, not {w.dtype}")
    (m, k), n = x.shape, w.shape[0]
    want = (cdiv(n, GROUP), cdiv(k, GROUP))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 {list(want)} (128x128 blocks), not {list(scale.shape)}")
    return m, n, k


def _fp8_gemm(x, w, scale, bias, w8a8: bool) -> torch.Tensor:
    m, n, k = _check(x, w, scale)
    if m == 0 or n == 0:  # no launch with an empty grid
        out = torch.zeros(m, n, dtype=x.dtype, device=x.device)
        return out if bias is None else out + bias
    cfg = gemm_config(m, n, k, _sms(x.device))
    if w8a8:
        a, a_scale = quantize_act(x)
    else:
        a, a_scale = x, None
    if cfg.split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        out_strides = (0, *out.stride())
    else:
        out = torch.empty(cfg.split, m, n, dtype=torch.float32, device=x.device)
        out_strides = out.stride()
    a_ss = a_scale.stride() if a_scale is not None else (0, 0)
    grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), cfg.split)
    _fp8_gemm_kernel[grid](
        a,
        a_scale if a_scale is not None else scale,
        w,
        scale,
        out,
        m,
        n,
        k,
        cfg.k_blocks_per_split,
        a.stride(0),
        a.stride(1),
        a_ss[0],
        a_ss[1],
        w.stride(0),
        w.stride(1),
        scale.stride(0),
        scale.stride(1),
        *out_strides,
        W8A8=w8a8,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.split > 1:
        out = out.sum(dim=0).to(x.dtype)  # the partials in a fixed order: the same bits every run
    if bias is not None:
        out = out + bias
    return out


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ (w [N, K] fp8 * 128x128 block scales).T (+ bias) -> [M, N] in x's dtype: w8a8,
    split-K for few rows (module docstring). No host sync, CUDA-graph capturable."""
    return _fp8_gemm(x, w, scale, bias, w8a8=True)


def fp8_linear_w8a16(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """As fp8_linear with x kept in bf16 (no activation quantization error; the weights' only)."""
    return _fp8_gemm(x, w, scale, bias, w8a8=False)


def scaled_mm_linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] bf16 @ (w [N, K] fp8 * 128x128 block scales).T (+ bias) -> [M, N] bf16 through torch's
    block-scaled scaled_mm (cuBLAS on sm90), for many rows (prefill). K must be a multiple of 512,
    N of 128, and M at least 2 there (SCALE_K_MULTIPLE); otherwise this is fp8_linear.

    Arguments, as seen working on an H200 (issue 39): A = x quantized per row and 128 columns, its
    scale (M, K/128) column-major (the storage of a [K/128, M] tensor, transposed), recipe
    BlockWise1x128; B = w.t() (K, N) column-major, its scale the checkpoint's [N/128, K/128]
    transposed (K/128, N/128), column-major, recipe BlockWise128x128. torch.nn.functional.scaled_mm
    takes (mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, ..., output_dtype) in
    torch 2.10 to 2.15 (checked against 2.13 and the 2.15 documentation); a torch without it, or
    whose signature differs (TypeError at the call, before any launch), goes to torch._scaled_mm,
    which infers the same block scaling from the scales' shapes on sm90."""
    m, n, k = _check(x, w, scale)
    if k % (SCALE_K_MULTIPLE * GROUP) or n % GROUP or m < 2:
        return fp8_linear(x, w, scale, bias)
    a, a_scale = quantize_act(x)
    a_scale = torch.empty(k // GROUP, m, device=x.device).t().copy_(a_scale)  # (M, K/128), column-major
    b_scale = scale.contiguous().t()  # (K/128, N/128), column-major
    fn = torch.nn.functional
    scaling = getattr(fn, "ScalingType", None)
    y = None
    if hasattr(fn, "scaled_mm") and scaling is not None:
        try:
            y = fn.scaled_mm(
                a,
                w.t(),
                scale_a=a_scale,
                scale_recipe_a=scaling.BlockWise1x128,
                scale_b=b_scale,
                scale_recipe_b=scaling.BlockWise128x128,
                output_dtype=x.dtype,
            )
        except TypeError:  # another signature: the older entry point below
            y = None
    if y is None:
        y = torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=x.dtype)
    return y if bias is None else y + bias
