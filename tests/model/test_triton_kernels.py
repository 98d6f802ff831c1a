"""The triton kernels (model/triton_moe.py, model/triton_gemm.py) on the CPU, through triton's
interpreter, against the torch references (model/moe_ops.py); the references against naive loops;
moe_align's invariants; neither syncs with the host (runtime/sync_check.py).

The interpreter. triton decides at `@triton.jit` time (knobs.runtime.interpret, which reads
TRITON_INTERPRET from the environment at each access) whether a kernel is compiled or interpreted,
so the `kern` fixture sets TRITON_INTERPRET=1 and imports the kernel modules afresh (put back as
they were afterwards). Two defects of triton 3.6's interpreter are patched for the module's
duration; `test_interpreter_defects_still_need_the_patches` fails once a triton release fixes them:
  - InterpreterBuilder.create_dot runs np.matmul on the uint16 storage of bfloat16 tiles (fp8 tiles
    it converts first): a bf16 tl.dot gives garbage. The patch widens bf16 operands to float32
    (bf16 bits << 16 is the float32 of the same value, exactly) before the original create_dot.
  - an int kernel argument is a 1-element numpy array, and a `for _ in range(n)` over one calls
    int() on it, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted"). The patch
    gives the interpreter's tensors an __index__ that reads the single element.

Tolerances: bf16 outputs are compared relative to the reference's norm (2e-2: bf16 rounding of the
intermediates); fp8 w8a8 against an emulation of its activation quantization to 1e-3, and against
moe_torch (unquantized activations) to 8e-2 (e4m3 keeps 3 mantissa bits: each quantized activation
is off by up to 1/16, about 2.5% rms per product, twice over in the MoE); float32 runs to 1e-5.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pdserve.model.moe_ops import dequant_linear, moe_torch
from pdserve.model.quant import dequantize_fp8, quantize_fp8
from pdserve.runtime.sync_check import forbid_host_sync
from tests.model.triton_interp import _ORIGINAL_DOT, BLOCK, interp, rel


def test_interpreter_defects_still_need_the_patches(kern, monkeypatch):
    a, b = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = a.float() @ b.float()
    c = torch.empty(16, 16)
    kern.dot[(1,)](a, b, c, N=16)  # patched
    assert rel(c, want) < 1e-6
    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", _ORIGINAL_DOT)
    kern.dot[(1,)](a, b, c, N=16)
    assert not rel(c, want) < 1e-2, "triton's interpreter multiplies bf16 right now: drop _create_dot"
    with pytest.raises(TypeError):  # numpy refuses int() of a 1-element array: _patch_lang_tensor stays
        int(np.array([3], dtype=np.int32))


# --- the torch references -------------------------------------------------------------------------


def fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (fp8 [E, N, K], float32 scales [E, ceil(N/128), ceil(K/128)]), as the checkpoints."""
    return quantize_fp8(w, BLOCK)


def moe_case(seed: int, tokens: int, k: int, hidden=256, inter=128, experts=8, drop=0.2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    ids[torch.rand(tokens, k, generator=g) < drop] = -1  # experts of another rank
    weights = torch.rand(tokens, k, generator=g)
    return x, w13, w2, weights, ids


def naive_moe(x, w13, w2, weights, ids):
    """Token by token, slot by slot, in float64 (the weights already dequantized)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_torch_float64_is_the_naive_loop(fp8):
    x, w13, w2, weights, ids = moe_case(1, tokens=9, k=3, hidden=200, inter=96, experts=6)
    x, w13, w2 = x.double(), w13.double(), w2.double()
    ids[2] = -1  # a token with no local expert: exactly 0
    if fp8:
        (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
        got = moe_torch(x, q13, q2, weights, ids, s13, s2)
        w13 = torch.stack([dequantize_fp8(q13[e], s13[e], BLOCK, torch.float64) for e in range(6)])
        w2 = torch.stack([dequantize_fp8(q2[e], s2[e], BLOCK, torch.float64) for e in range(6)])
    else:
        got = moe_torch(x, w13, w2, weights, ids)
    want = naive_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.float64
    assert (got[2] == 0).all()
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_dequant_linear_is_dequantize_then_multiply():
    g = torch.Generator().manual_seed(2)
    n, k = 300, 260  # partial edge blocks both ways
    w = torch.randn(n, k, generator=g)
    q, scale = quantize_fp8(w, BLOCK)
    scale = torch.exp2(torch.round(torch.log2(scale)))  # powers of two: every sum below is exact
    x = torch.randint(-4, 5, (5, k), generator=g).double()
    full = dequantize_fp8(q, scale, BLOCK, torch.float64)
    bias = torch.randint(-3, 4, (n,), generator=g).double()
    assert torch.equal(dequant_linear(x, q, scale), x @ full.T)
    assert torch.equal(dequant_linear(x, q, scale, bias=bias), x @ full.T + bias)
    xr = torch.randn(7, k, generator=g, dtype=torch.float64)  # any values: to rounding
    assert (dequant_linear(xr, q, scale) - xr @ full.T).abs().max() <= 1e-12
    y32 = dequant_linear(xr.float(), q, scale)
    assert y32.dtype == torch.float32 and rel(y32, xr @ full.T) < 1e-6


# --- moe_align ------------------------------------------------------------------------------------


def check_align(moe, ids: torch.Tensor, n_experts: int, block_m: int) -> None:
    sorted_ids, block_expert = moe.moe_align(ids, n_experts, block_m)
    pairs = ids.numel()
    em = moe.padded_pairs(pairs, n_experts, block_m)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert sorted_ids.shape == (em,) and block_expert.shape == (em // block_m,) and em % block_m == 0
    flat = ids.flatten().tolist()
    s, be = sorted_ids.tolist(), block_expert.tolist()
    valid = [p for p, e in enumerate(flat) if 0 <= e < n_experts]
    real = [p for p in s if p != pairs]
    assert sorted(real) == valid and all(0 <= p <= pairs for p in s)  # each valid pair once, else padding
    used = [e for e in be if e >= 0]
    assert be == used + [-1] * (len(be) - len(used))  # the used blocks first
    assert used == sorted(used)  # one run of blocks per expert, experts ascending
    for e in set(used):
        run = [p for b, eb in enumerate(be) if eb == e for p in s[b * block_m : (b + 1) * block_m]]
        mine = [p for p in valid if flat[p] == e]
        assert len(run) == -(-len(mine) // block_m) * block_m  # padded to whole blocks, no more
        assert run == mine + [pairs] * (len(run) - len(mine))  # its pairs in order, then padding
    assert set(used) == {flat[p] for p in valid}
    assert all(p == pairs for p in s[len(used) * block_m :])


def test_moe_align_invariants(kern):
    g = torch.Generator().manual_seed(3)
    for case in range(300):
        tokens = int(torch.randint(1, 12, (1,), generator=g))
        n_experts = int(torch.randint(1, 10, (1,), generator=g))
        k = int(torch.randint(1, 5, (1,), generator=g))
        block_m = (1, 2, 4, 16)[case % 4]
        ids = torch.randint(-1, n_experts, (tokens, k), generator=g)
        check_align(kern.moe, ids.to((torch.int64, torch.int32)[case % 2]), n_experts, block_m)
    check_align(kern.moe, torch.full((4, 2), -1), 8, 16)  # every expert on another rank
    check_align(kern.moe, torch.zeros(40, 8, dtype=torch.int64), 8, 16)  # one expert takes all


def test_moe_align_and_fused_moe_do_not_sync(kern):
    x, w13, w2, weights, ids = moe_case(4, tokens=5, k=2)
    with forbid_host_sync():
        kern.moe.moe_align(ids, 8, 16)
        kern.moe.fused_moe(x, w13, w2, weights, ids)  # its torch ops; the interpreter's launch too


# --- fused_moe ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,k", [(1, 4), (3, 2), (17, 3)])
def test_fused_moe_bf16(kern, tokens, k):
    x, w13, w2, weights, ids = (t.bfloat16() if t.is_floating_point() else t for t in moe_case(5, tokens, k))
    weights = weights.float()
    got = kern.moe.fused_moe(x, w13, w2, weights, ids)
    want = moe_torch(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert rel(got, want) < 2e-2


@pytest.mark.parametrize(
    "tokens,hidden,inter", [(17, 256, 128), (80, 256, 128), (6, 200, 96)], ids=["decode", "prefill", "edges"]
)
def test_fused_moe_float32(kern, tokens, hidden, inter):
    """Same math in float32: only the order of the sums differs. 80 tokens x 4 slots over 8 experts
    take the prefill tiles (BLOCK_M 64); 200 / 96 leave partial k and n tiles."""
    x, w13, w2, weights, ids = moe_case(6, tokens, 4, hidden, inter)
    ids[1] = -1  # a token whose experts are all on other ranks
    assert kern.moe.moe_config(ids.numel(), 2 * inter, hidden, 8).block_m == (64 if tokens == 80 else 16)
    got = kern.moe.fused_moe(x, w13, w2, weights, ids)
    assert rel(got, moe_torch(x, w13, w2, weights, ids)) < 1e-5
    assert (got[(ids < 0).all(dim=1)] == 0).all()


def emulate_w8a8(moe, x, q13, s13, q2, s2, weights, ids):
    """moe_torch with the activations quantized as the w8a8 kernels do (per row and 128 columns)."""

    def through_fp8(a):
        q, s = moe.quantize_act(a)
        return dequantize_fp8(q, s, (1, 128), torch.float32)

    out = torch.zeros(x.shape)
    xd = through_fp8(x.float())
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate, up = (xd[t : t + 1] @ dequantize_fp8(q13[e], s13[e], BLOCK, torch.float32).T).chunk(2, -1)
            h = through_fp8(torch.nn.functional.silu(gate) * up)
            out[t] += weights[t, j] * (h @ dequantize_fp8(q2[e], s2[e], BLOCK, torch.float32).T)[0]
    return out


@pytest.mark.parametrize("tokens,hidden,inter", [(3, 256, 128), (17, 256, 128), (6, 200, 96)])
def test_fused_moe_fp8_w8a8(kern, tokens, hidden, inter):
    x, w13, w2, weights, ids = moe_case(7, tokens, 4, hidden, inter)
    (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
    got = kern.moe.fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=True)
    assert rel(got, emulate_w8a8(kern.moe, x, q13, s13, q2, s2, weights, ids)) < 1e-3
    assert rel(got, moe_torch(x, q13, q2, weights, ids, s13, s2)) < 8e-2
    got16 = kern.moe.fused_moe(x.bfloat16(), q13, q2, weights, ids, s13, s2, fp8_act=True)
    # bf16 inputs and intermediates move some values across an fp8 rounding boundary: 1-2% apart
    x16 = x.bfloat16().float()
    assert rel(got16, emulate_w8a8(kern.moe, x16, q13, s13, q2, s2, weights, ids)) < 4e-2
    assert got16.dtype == torch.bfloat16 and rel(got16, moe_torch(x16, q13, q2, weights, ids, s13, s2)) < 8e-2


@pytest.mark.parametrize("tokens,hidden,inter", [(17, 256, 128), (6, 200, 96)])
def test_fused_moe_fp8_w8a16(kern, tokens, hidden, inter):
    x, w13, w2, weights, ids = moe_case(8, tokens, 3, hidden, inter)
    (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
    want = moe_torch(x, q13, q2, weights, ids, s13, s2)
    got = kern.moe.fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=False)
    assert rel(got, want) < 1e-5  # float32 activations: the dequantized weights exactly
    got16 = kern.moe.fused_moe(x.bfloat16(), q13, q2, weights, ids, s13, s2, fp8_act=False)
    assert got16.dtype == torch.bfloat16 and rel(got16, want) < 2e-2


@pytest.mark.parametrize("tokens", [1, 3])  # 4 and 12 pairs
def test_fused_moe_per_pair_blocks_equal_the_grouped_ones(kern, monkeypatch, tokens):
    """Up to PER_PAIR_MAX pairs each pair is a block of its own (no moe_align): the same sums as
    the grouped path, for fp8 (w8a16, the default there; w8a8) and float32 weights, ids -1 included."""
    moe = kern.moe
    x, w13, w2, weights, ids = moe_case(10 + tokens, tokens, 4)
    (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)

    def three():
        return [
            moe.fused_moe(x, w13, w2, weights, ids),
            moe.fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=False),
            moe.fused_moe(x, q13, q2, weights, ids, s13, s2, fp8_act=True),
        ]

    per_pair, default = three(), moe.fused_moe(x, q13, q2, weights, ids, s13, s2)
    monkeypatch.setattr(moe, "PER_PAIR_MAX", 0)
    for a, b in zip(per_pair, three()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(default, per_pair[1])
    assert rel(default, moe_torch(x, q13, q2, weights, ids, s13, s2)) < 1e-5  # w8a16: exact weights


@pytest.mark.parametrize("tokens", [2, 11])  # one pair a block; grouped (33 pairs)
def test_fused_moe_split_k(kern, monkeypatch, tokens):
    """MoeConfig.split 3 over K = 456 (4 steps, the last partial: 2 programs of 2 steps, as the
    wrapper never makes a program without a step) and K = 128 (one step, one program): the float32
    partials sum to the unsplit result, fp8 and float32 weights, ids -1 included."""
    moe = kern.moe
    x, w13, w2, weights, ids = moe_case(20 + tokens, tokens, 3, hidden=456, inter=128, experts=4)
    (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
    whole = [moe.fused_moe(x, w13, w2, weights, ids), moe.fused_moe(x, q13, q2, weights, ids, s13, s2)]
    tiles = moe.moe_config
    monkeypatch.setattr(moe, "moe_config", lambda p, n, k, e: replace(tiles(p, n, k, e), split=3))
    split = [moe.fused_moe(x, w13, w2, weights, ids), moe.fused_moe(x, q13, q2, weights, ids, s13, s2)]
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert rel(split[0], moe_torch(x, w13, w2, weights, ids)) < 1e-5


def test_fused_moe_other_tiles(kern, monkeypatch):
    """BLOCK_N 64 and GROUP_M 2 (what the H200 runs take) over the same case."""
    moe = kern.moe
    x, w13, w2, weights, ids = moe_case(9, 17, 4)
    monkeypatch.setattr(moe, "moe_config", lambda p, n, k, e: moe.MoeConfig(16, 64, 128, 2, 4, 4))
    assert rel(moe.fused_moe(x, w13, w2, weights, ids), moe_torch(x, w13, w2, weights, ids)) < 1e-5


def test_fused_moe_rejects_mismatched_inputs(kern):
    x, w13, w2, weights, ids = moe_case(10, 2, 2)
    with pytest.raises(ValueError, match="w13_scale"):
        kern.moe.fused_moe(x, *fp8_experts(w13)[:1], fp8_experts(w2)[0], weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        kern.moe.fused_moe(x, w13, w2[:, :, :64], weights, ids)


def test_moe_config_decode_fills_an_h200(kern):
    moe = kern.moe
    for n, k in ((4096, 6144), (6144, 2048)):  # GLM-5's products at batch 1: 8 pairs, 8 experts hit
        cfg = moe.moe_config(8, n, k, 256)
        assert cfg.block_m == 16 and cfg.block_k == 128
        assert 8 * moe.cdiv(n, cfg.block_n) >= 2 * moe.SMS
    prefill = moe.moe_config(8192 * 8, 4096, 6144, 256)
    assert (prefill.block_m, prefill.block_n) == (64, 128)
    for cfg in (moe.moe_config(p, n, 6144, 256) for p in (1, 8, 256, 65536) for n in (64, 576, 4096)):
        assert all(v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k))  # powers of two
        assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 32  # tl.dot's minimums


@pytest.mark.parametrize("tokens", [2, 9])  # one pair a block; grouped
def test_moe_layer_on_the_triton_ops_with_its_shared_expert_folded(kern, tokens):
    """The model's MoE block (router, experts, shared expert) on --moe-ops triton, its shared expert
    folded into the fused call (engine/gemm_ops.set_gemm_ops), against the same block on torch ops."""
    from pdserve.checkpoints.presets import hf_config
    from pdserve.engine.gemm_ops import set_gemm_ops
    from pdserve.model.config import ModelConfig
    from pdserve.model.layers import MoE

    d = hf_config("glm_moe_dsa", "tiny")
    d.update(hidden_size=256, moe_intermediate_size=128)
    cfg = ModelConfig.from_dict(d)
    torch.manual_seed(tokens)
    m = MoE(cfg)
    for p in m.parameters():
        p.data = torch.randn(p.shape) * p.shape[-1] ** -0.5
    x = torch.randn(tokens, cfg.hidden_size)
    want = m(x)
    set_gemm_ops(m, "torch", "triton")
    assert m.shared_experts is None
    assert rel(m(x), want) < 1e-5
