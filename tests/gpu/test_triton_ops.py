"""The triton kernels compiled for this GPU (model/triton_moe.py, model/triton_gemm.py) and torch's
block-scaled scaled_mm, at GLM-5's dims, against the torch references (model/moe_ops.py).

GLM-5's routed experts are 256 of H = 6144, I = 2048 with 8 per token; here 32 such experts (ids
drawn from 0..31, every tenth slot -1 as for another rank's expert) keep the weights at 2.4 GB in
bf16. T = 1 and 32 take the decode tiles (BLOCK_M 16), T = 512 the prefill ones (BLOCK_M 64).
The products: K = 6144 into N = 2048 and into N = 576 (the kv_a projection's, not a multiple of
128), at M = 1, 32 and 4096.

Tolerances (relative to the reference's norm): bf16 and w8a16 2e-2 (bf16 intermediates); w8a8
8e-2 against the unquantized activations (e4m3 activations: about 4% here and on the CPU), and
1e-2 against an emulation of its activation quantization (same fp8 values, bf16 intermediates as
the kernels store them). Sync-freedom: torch.cuda.set_sync_debug_mode("error") around warm calls;
static shapes: a CUDA graph captured once replays the eager result bit for bit, for new ids too.
About 10 + 5 kernel compilations; under a minute on an H200.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.moe_ops import dequant_linear, moe_torch
from pdserve.model.quant import dequantize_fp8, quantize_fp8
from pdserve.model.triton_gemm import fp8_linear, fp8_linear_w8a16, scaled_mm_linear
from pdserve.model.triton_moe import fused_moe, quantize_act

CUDA = torch.device("cuda", 0)
H, I, E, K_TOP = 6144, 2048, 32, 8
BLOCK = (128, 128)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(CUDA).manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=CUDA, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=CUDA, generator=g) / I**0.5).bfloat16()
    (q13, s13), (q2, s2) = quantize_fp8(w13, BLOCK), quantize_fp8(w2, BLOCK)  # on the GPU, stacked
    return {"bf16": (w13, w2, None, None), "fp8": (q13, q2, s13, s2)}


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(CUDA).manual_seed(seed)
    x = torch.randn(tokens, H, device=CUDA, generator=g).bfloat16()
    ids = torch.rand(tokens, E, device=CUDA, generator=g).argsort(dim=1)[:, :K_TOP]  # distinct per token
    ids = torch.where(torch.rand(tokens, K_TOP, device=CUDA, generator=g) < 0.1, -1, ids)
    weights = torch.rand(tokens, K_TOP, device=CUDA, generator=g)
    return x, weights, ids


def emulate_w8a8(x, q13, q2, s13, s2, weights, ids):
    """moe_torch with the w8a8 kernels' roundings: activations through quantize_act, gate/up and
    each pair's output stored in bf16."""

    def through_fp8(a):
        q, s = quantize_act(a)
        return dequantize_fp8(q, s, (1, 128), torch.float32)

    xd = through_fp8(x)
    out = torch.zeros(x.shape, device=x.device)
    flat = ids.flatten()
    for e in sorted(set(flat.tolist()) - {-1}):
        sel = (flat == e).nonzero().flatten()
        tok = sel // K_TOP
        gu = (xd[tok] @ dequantize_fp8(q13[e], s13[e], BLOCK, torch.float32).T).bfloat16().float()
        h = through_fp8(F.silu(gu[:, :I]) * gu[:, I:])
        y = (
            h @ dequantize_fp8(q2[e], s2[e], BLOCK, torch.float32).T * weights.flatten()[sel, None]
        ).bfloat16()
        out.index_add_(0, tok, y.float())
    return out


@pytest.mark.parametrize("tokens", [1, 32, 512])
def test_fused_moe_bf16(experts, tokens):
    x, weights, ids = routing(tokens, tokens)
    w13, w2, _, _ = experts["bf16"]
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert rel(got, moe_torch(x, w13, w2, weights, ids)) < 2e-2


@pytest.mark.parametrize("tokens", [1, 32, 512])
def test_fused_moe_fp8_w8a8(experts, tokens):
    x, weights, ids = routing(tokens, 100 + tokens)
    q13, q2, s13, s2 = experts["fp8"]
    got = fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=True)
    assert got.dtype == torch.bfloat16
    assert rel(got, emulate_w8a8(x, q13, q2, s13, s2, weights, ids)) < 1e-2
    assert rel(got, moe_torch(x, q13, q2, weights, ids, s13, s2)) < 8e-2


def test_fused_moe_fp8_w8a16(experts):
    x, weights, ids = routing(32, 200)
    q13, q2, s13, s2 = experts["fp8"]
    got = fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=False)
    assert rel(got, moe_torch(x, q13, q2, weights, ids, s13, s2)) < 2e-2


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_fused_moe_no_sync_and_cuda_graph(experts, kind):
    x, weights, ids = routing(32, 300)
    args = (x, *experts[kind][:2], weights, ids, *experts[kind][2:])
    fused_moe(*args)  # compiled (warm-up)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = fused_moe(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_moe(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    x2, weights2, ids2 = routing(32, 301)  # other tokens and other experts, same shapes
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fused_moe(*args))


def linear_case(m: int, n: int, seed: int):
    g = torch.Generator(CUDA).manual_seed(seed)
    x = torch.randn(m, H, device=CUDA, generator=g).bfloat16()
    q, scale = quantize_fp8(torch.randn(n, H, device=CUDA, generator=g) / H**0.5, BLOCK)
    return x, q, scale


def act_emulated(x, q, scale):
    xq, xs = quantize_act(x)
    return dequant_linear(dequantize_fp8(xq, xs, (1, 128), torch.float32), q, scale)


@pytest.mark.parametrize("m", [1, 32, 4096])
@pytest.mark.parametrize("n", [2048, 576])
def test_fp8_linear(m, n):
    x, q, scale = linear_case(m, n, m + n)
    got = fp8_linear(x, q, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel(got, act_emulated(x, q, scale)) < 1e-2
    assert rel(got, dequant_linear(x, q, scale)) < 6e-2
    if m == 32:
        assert rel(fp8_linear_w8a16(x, q, scale), dequant_linear(x, q, scale)) < 1e-2
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = fp8_linear(x, q, scale)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(again, got)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fp8_linear(x, q, scale)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            static_out = fp8_linear(x, q, scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, got)


@pytest.mark.parametrize("m", [1, 32, 4096])
@pytest.mark.parametrize("n", [2048, 576])
def test_scaled_mm_linear(m, n):
    """torch's block-scaled scaled_mm (N = 2048); N = 576 is not a multiple of 128: fp8_linear."""
    x, q, scale = linear_case(m, n, 10 * m + n)
    got = scaled_mm_linear(x, q, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel(got, act_emulated(x, q, scale)) < 1e-2
    assert rel(got, dequant_linear(x, q, scale)) < 6e-2
