"""The triton fp8 GEMM (model/triton_gemm.py) through triton's CPU interpreter (tests/model/triton_interp.py)
against the torch reference (model/moe_ops.dequant_linear), torch's scaled_mm path's layouts, and every
kernel variant the H200 check launches compiled for sm90 on the CPU (tolerances: test_triton_kernels.py)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from pdserve.model.moe_ops import dequant_linear
from pdserve.model.quant import dequantize_fp8, quantize_fp8
from tests.model.triton_interp import (
    BLOCK,
    KERNEL_MODULES,
    SM90_SHARED_MAX,
    CompileForSm90,
    _restore,
    rel,
    triton,
)

# --- fp8_linear -----------------------------------------------------------------------------------


def linear_case(seed, m, n, k):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_fp8(torch.randn(n, k, generator=g), BLOCK)
    return torch.randn(m, k, generator=g), q, scale


@pytest.mark.parametrize(
    "m,n,k,sms",
    [(1, 200, 300, 132), (5, 576, 640, 132), (40, 130, 260, 132), (100, 256, 384, 1), (3, 96, 1000, 3)],
    ids=["split3", "split5", "bm64-split", "no-split", "3-kblocks-per-split"],
)
def test_fp8_linear(kern, monkeypatch, m, n, k, sms):
    gemm = kern.gemm
    monkeypatch.setattr(gemm, "_sms", lambda device: sms)
    cfg = gemm.gemm_config(m, n, k, sms)
    x, q, scale = linear_case(11, m, n, k)
    want = dequant_linear(x, q, scale)
    xq, xs = kern.moe.quantize_act(x)
    want8 = dequant_linear(dequantize_fp8(xq, xs, (1, 128), torch.float32), q, scale)
    assert rel(gemm.fp8_linear(x, q, scale), want8) < 1e-5
    assert rel(gemm.fp8_linear(x, q, scale), want) < 6e-2
    assert rel(gemm.fp8_linear_w8a16(x, q, scale), want) < 1e-5
    y = gemm.fp8_linear(x.bfloat16(), q, scale, bias=torch.ones(n, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and rel(y - 1, want8) < 2e-2
    assert rel(gemm.fp8_linear_w8a16(x.bfloat16(), q, scale), want) < 2e-2
    if m == 3:
        assert (cfg.split, cfg.k_blocks_per_split) == (3, 3)  # 8 k steps: 3 + 3 + 2


def test_gemm_config_split_k(kern):
    gemm = kern.gemm
    for n in (2048, 576):
        cfg = gemm.gemm_config(1, n, 6144)
        programs = gemm.cdiv(n, cfg.block_n) * cfg.split
        assert cfg.split > 1 and programs >= 132 and (cfg.split - 1) * cfg.k_blocks_per_split < 48
    assert gemm.gemm_config(4096, 2048, 6144).split == 1


def test_quantize_act(kern):
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(12)) * 10
    x[1, 128:256] = 0  # an all-zero group: a tiny scale, zeros
    q, s = kern.moe.quantize_act(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and s.shape == (5, 3)
    assert (s > 0).all() and (q[1, 128:256].float() == 0).all()
    assert (q.float().abs().amax(dim=1) == 448).all()  # each row's largest value maps to 448
    back = dequantize_fp8(q, s, (1, 128), torch.float32)
    half_ulp = x.abs() / 16 + s.repeat_interleave(128, 1)[:, :300] / 1024  # 3 mantissa bits; subnormals
    assert ((back - x).abs() <= half_ulp).all()


def test_scaled_mm_linear_arguments(kern, monkeypatch):
    """torch's scaled_mm does not run on the CPU: a stand-in checks the layouts that worked on the
    H200 (issue 39) and multiplies as the recipes say."""
    gemm, seen = kern.gemm, []
    x, q, scale = linear_case(13, 6, 256, 512)

    def fake(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, output_dtype):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride() == (1, k)  # B column-major
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)  # column-major
        assert scale_b.shape == (k // 128, n // 128) and scale_b.stride() == (1, k // 128)
        assert scale_recipe_a == F.ScalingType.BlockWise1x128
        assert scale_recipe_b == F.ScalingType.BlockWise128x128
        seen.append(output_dtype)
        ad = dequantize_fp8(a, scale_a, (1, 128), torch.float32)
        return dequant_linear(ad, b.t(), scale_b.t()).to(output_dtype)

    F = torch.nn.functional
    monkeypatch.setattr(F, "scaled_mm", fake, raising=False)
    xq, xs = kern.moe.quantize_act(x)
    want8 = dequant_linear(dequantize_fp8(xq, xs, (1, 128), torch.float32), q, scale)
    assert rel(gemm.scaled_mm_linear(x, q, scale), want8) < 1e-6 and seen == [torch.float32]
    x2, q2, scale2 = linear_case(14, 6, 200, 384)  # N not a multiple of 128: the triton GEMM
    assert rel(gemm.scaled_mm_linear(x2, q2, scale2), dequant_linear(x2, q2, scale2)) < 6e-2
    for m, n, k in ((6, 256, 384), (1, 256, 512)):  # K/128 not a multiple of 4, one row: triton's
        x3, q3, scale3 = linear_case(15, m, n, k)
        assert rel(gemm.scaled_mm_linear(x3, q3, scale3), dequant_linear(x3, q3, scale3)) < 6e-2
    assert len(seen) == 1


# --- compiled for an H200, on the CPU -------------------------------------------------------------


def test_kernels_compile_for_sm90(monkeypatch, tmp_path):
    """Every kernel variant the H200 check (tests/gpu/test_triton_ops.py) launches, at GLM-5's dims,
    compiled for sm90 (no GPU needed: triton's front end, its sm90 passes, LLVM and ptxas run on the
    CPU), within sm90's shared memory. The weights are never read (torch.empty)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    ptxas = __import__("pathlib").Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.is_file():
        pytest.skip("this triton has no nvidia backend (ptxas)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile, do not reuse a cache
    saved = {name: sys.modules.pop(name, None) for name in KERNEL_MODULES}
    try:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        moe, gemm = (importlib.import_module(name) for name in KERNEL_MODULES)  # compiled kernels
        target = GPUTarget("cuda", 90, 32)
        backend, compiled = make_backend(target), []
        monkeypatch.setattr(
            moe, "_moe_gemm_kernel", CompileForSm90(moe._moe_gemm_kernel, backend, target, compiled)
        )
        monkeypatch.setattr(
            gemm, "_fp8_gemm_kernel", CompileForSm90(gemm._fp8_gemm_kernel, backend, target, compiled)
        )

        hidden, inter, experts, k = 6144, 2048, 32, 8
        shapes = (experts, 2 * inter, hidden), (experts, hidden, inter)
        w13, w2 = (torch.empty(shape, dtype=torch.bfloat16) for shape in shapes)  # never touched
        q13, q2 = (torch.empty(shape, dtype=torch.float8_e4m3fn) for shape in shapes)
        s13, s2 = (
            torch.ones(experts, 2 * inter // 128, hidden // 128),
            torch.ones(experts, hidden // 128, inter // 128),
        )
        for tokens in (1, 32, 512):  # decode tiles one pair a block, decode tiles grouped, prefill
            x, ids, weights = (
                torch.zeros(tokens, hidden).bfloat16(),
                torch.zeros(tokens, k, dtype=torch.int64),
                torch.ones(tokens, k),
            )
            moe.fused_moe(x, w13, w2, weights, ids)
            moe.fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=True)
            moe.fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=False)
        for m in (1, 32, 4096):
            x, q, s = (
                torch.zeros(m, hidden).bfloat16(),
                torch.empty(2048, hidden, dtype=torch.float8_e4m3fn),
                torch.ones(16, 48),
            )
            gemm.fp8_linear(x, q, s)
            gemm.fp8_linear_w8a16(x, q, s)
    finally:
        _restore(saved)
    assert len(compiled) == 24  # 3 modes x 2 products x 3 tile sets; 2 modes x 3 row tiles
    for _, out in compiled:
        assert out.asm.get("cubin") and out.metadata.shared <= SM90_SHARED_MAX
