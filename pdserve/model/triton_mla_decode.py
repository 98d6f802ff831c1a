"""MLA decode attention in absorbed form as one triton kernel, reading the KV cache as stored.

  mla_decode(q [B, H, C + R], table [N, C + R], rows [B, S] int64 (-1: no key), sm_scale, dv=C,
             kv_scale=1.0) -> (out [B, H, C] in q's dtype, lse [B, H] float32, natural log)

Query b attends over table[rows[b, s]] for every s with rows[b, s] >= 0: a request's own rows on a
DCP rank (dense models) or its selected top-k rows (DSA): the caller's list, in any order, of any
length per request (-1 padded). The value of a key is its first dv = C values (the latent c_kv).
Scores are sm_scale * kv_scale * (q . k); values are kv_scale * k[:C]. The table may be float8_e4m3fn
(the pool's fp8 cache, whose static scale is kv_scale: kvcache/kv_cache.py stores latent entries with
scale 1.0), bfloat16, float16 or float32; a tile is converted to the dot dtype in registers (fp8 ->
bf16 is exact), never as a copy of the cache. Accumulation is float32 (online softmax, as flash
decoding does). A query with no key gets lse -inf and out exactly 0: what the DCP merge needs
(docs/design.md invariant 5).

Dots: bf16 / fp16 queries multiply in their dtype with float32 accumulation (the probabilities are
rounded to it for the value dot, as FlashAttention does); float32 queries multiply in float32
(input_precision "ieee": no tf32), the exact variant the CPU interpreter tests check to 1e-5.

Grid (B, ceil(H / BLOCK_H), SPLIT): a program owns BLOCK_H heads of one request and one of SPLIT
contiguous ranges of its S key columns (split-KV, `decode_config`): a few long requests still fill
the SMs. Each writes a float32 (out, lse) partial and torch merges the SPLIT partials with the exact
log-sum-exp rule (model/kernels.merge_attention), in a fixed order: no atomics, deterministic. Every
shape depends only on (B, H, S, dims), no host sync, so a step with it can be captured in a CUDA graph.

Like model/triton_moe.py's, the kernel calls only triton.language builtins, so it runs in triton's
interpreter (TRITON_INTERPRET=1 before this module's import) even when triton was imported before:
its two reductions are tl.reduce with the combine functions tl.max / tl.sum pass (which the
interpreter recognises), not those @jit helpers themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kernels import merge_attention
from .triton_gemm import _sms
from .triton_moe import SMS, cdiv

BLOCK_N = 32  # keys per inner step
BLOCK_H = 16  # heads per program (tl.dot's minimum M)


@dataclass(frozen=True)
class DecodeConfig:
    split: int  # programs per (request, head block) along the keys
    per_split: int  # key columns per program, a multiple of BLOCK_N


def decode_config(b: int, h: int, s: int, sms: int = SMS) -> DecodeConfig:
    """Split the S key columns so that B x ceil(H / BLOCK_H) x split programs cover 2 x sms, each
    with at least one BLOCK_N step (pure function of the shapes)."""
    steps = max(1, cdiv(s, BLOCK_N))
    tiles = b * cdiv(h, BLOCK_H)
    split = max(1, min(steps, cdiv(2 * sms, tiles)))
    per = cdiv(steps, split)
    return DecodeConfig(cdiv(steps, per), per * BLOCK_N)


@triton.jit(do_not_specialize=["S", "per_split"])  # one compile per shape class, not per context length
def _mla_decode_kernel(
    q_ptr,
    t_ptr,
    rows_ptr,
    out_ptr,
    lse_ptr,
    H,
    S,
    per_split,
    stride_qb,
    stride_qh,
    stride_t,
    stride_rb,
    score_scale,
    C: tl.constexpr,
    R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HH: tl.constexpr,
    BLOCK_NN: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    B = tl.num_programs(0)
    heads = hb * BLOCK_HH + tl.arange(0, BLOCK_HH)
    hmask = heads < H
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < C
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < R
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_c[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)
    q_r = tl.load(q_row + C + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    dot_dtype = q_c.dtype
    m = tl.full([BLOCK_HH], float("-inf"), dtype=tl.float32)
    l_sum = tl.full([BLOCK_HH], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_HH, BLOCK_C], 0.0, dtype=tl.float32)
    start = sp * per_split
    end = tl.minimum(start + per_split, S)
    for n0 in range(start, end, BLOCK_NN):
        offs_n = n0 + tl.arange(0, BLOCK_NN)
        row = tl.load(rows_ptr + b * stride_rb + offs_n, mask=offs_n < end, other=-1)
        ok = row >= 0
        k_row = t_ptr + tl.where(ok, row, 0).to(tl.int64)[:, None] * stride_t
        k_c = tl.load(k_row + offs_c[None, :], mask=ok[:, None] & cmask[None, :], other=0.0).to(dot_dtype)
        k_r = tl.load(k_row + C + offs_r[None, :], mask=ok[:, None] & rmask[None, :], other=0.0).to(dot_dtype)
        if IEEE:
            s = tl.dot(q_c, tl.trans(k_c), input_precision="ieee")
            s += tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        else:
            s = tl.dot(q_c, tl.trans(k_c))
            s += tl.dot(q_r, tl.trans(k_r))
        s = tl.where(ok[None, :], s * score_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp(-inf - 0) = 0
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, k_c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), k_c)
        m = m_new
    seen = l_sum > 0
    out = acc / tl.where(seen, l_sum, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l_sum, 1.0)), float("-inf"))
    at = (sp * B + b) * H + heads  # partials [SPLIT, B, H, ...]
    tl.store(out_ptr + at[:, None] * C + offs_c[None, :], out, mask=hmask[:, None] & cmask[None, :])
    tl.store(lse_ptr + at, lse, mask=hmask)


def mla_decode(
    q: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    sm_scale: float,
    dv: int,
    kv_scale: float = 1.0,
    config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, dv] in q's dtype, lse [B, H] float32): see the module docstring."""
    B, H, D = q.shape
    S = rows.shape[1]
    if table.shape[-1] != D or table.stride(-1) != 1 or not 0 < dv <= D:
        raise ValueError(
            f"table [N, {D}] with unit last stride and 0 < dv <= {D} expected, got {tuple(table.shape)}"
        )
    q = q if q.stride(-1) == 1 else q.contiguous()
    rows = rows.contiguous()
    if B == 0 or S == 0:
        out = torch.zeros(B, H, dv, dtype=q.dtype, device=q.device)
        return out, torch.full((B, H), float("-inf"), dtype=torch.float32, device=q.device)
    cfg = config or decode_config(B, H, S, _sms(q.device))
    out = torch.empty(cfg.split, B, H, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(cfg.split, B, H, dtype=torch.float32, device=q.device)
    grid = (B, cdiv(H, BLOCK_H), cfg.split)
    _mla_decode_kernel[grid](
        q,
        table,
        rows,
        out,
        lse,
        H,
        S,
        cfg.per_split,
        q.stride(0),
        q.stride(1),
        table.stride(0),
        rows.stride(0),
        float(sm_scale) * float(kv_scale),
        C=dv,
        R=D - dv,
        BLOCK_C=triton.next_power_of_2(dv),
        BLOCK_R=max(triton.next_power_of_2(D - dv), 16),
        BLOCK_HH=BLOCK_H,
        BLOCK_NN=BLOCK_N,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
        num_stages=2,
    )
    out, lse = merge_attention(out, lse) if cfg.split > 1 else (out[0], lse[0])
    return (out * kv_scale if kv_scale != 1.0 else out).to(q.dtype), lse
