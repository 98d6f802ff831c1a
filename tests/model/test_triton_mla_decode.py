"""The MLA decode kernel (model/triton_mla_decode.py) on the CPU through triton's interpreter, against
the torch reference: the cache dequantized, gathered and attended in float64 (model/kernels.attend).

Cases: lengths that differ per request and are not multiples of the kernel's 32-key step, selected
rows in any order with -1 padding (the DSA decode's top-k positions, a DCP rank's share), a request
with no key (lse -inf, out exactly 0), heads not a multiple of the 16-head block, dv not a power of
two, the split-KV partials merged, an fp8 cache with a kv_scale; then the wiring: engine/attn_ops'
TritonOps over real pools and a DCP decode step of the tiny DSA model over an fp8 pool. Tolerances: float32 queries
multiply in float32 (1e-5 relative); bf16 ones round the probabilities to bf16 (2e-2).
The interpreter patches are tests/model/triton_interp.py's (test_triton_kernels.py's docstring says why)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from pdserve.checkpoints.presets import hf_config
from pdserve.engine.attn_ops import TorchOps, TritonOps, attend_cached
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig
from pdserve.model.kernels import attend
from pdserve.runtime.sync_check import forbid_host_sync
from tests.model.triton_interp import _create_dot, _patch_lang_tensor, _restore, interp, rel

MODULE = "pdserve.model.triton_mla_decode"
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def mla():
    saved = {MODULE: sys.modules.pop(MODULE, None)}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            mp.setattr(interp.InterpreterBuilder, "create_dot", _create_dot)
            mp.setattr(interp, "_patch_lang_tensor", _patch_lang_tensor)
            yield importlib.import_module(MODULE)
    finally:
        _restore(saved)


def case(seed: int, lengths: list[int], heads: int, c: int, r: int, n: int = 160):
    """q [B, H, c + r], a table of n entries, rows [B, max(lengths)]: distinct rows in random order,
    -1 after each request's length."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), heads, c + r, generator=g)
    table = torch.randn(n, c + r, generator=g) * 2
    rows = torch.full((len(lengths), max(lengths)), -1, dtype=torch.int64)
    for b, length in enumerate(lengths):
        rows[b, :length] = torch.randperm(n, generator=g)[:length]
    return q, table, rows


def reference(q, table, rows, scale: float, dv: int, kv_scale: float = 1.0):
    """Dequantize, gather, attend in float64."""
    keys = table.double()[rows.clamp(min=0)] * kv_scale  # [B, S, D]
    return attend(q.double(), keys, rows >= 0, scale, dv)


def check(got, want, tol: float):
    (out, lse), (out_w, lse_w) = got, want
    assert lse.dtype == torch.float32
    empty = torch.isinf(lse_w)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all()
    assert (out[empty[..., None].expand_as(out)] == 0).all()  # no key: exactly zero, never NaN
    assert rel(out, out_w) < tol and rel(lse[~empty], lse_w[~empty]) < tol


@pytest.mark.parametrize("split", [None, 1, 3])
def test_fp8_cache_float32_queries(mla, split):
    lengths = [1, 37, 70, 0, 33]  # one step; two; three partial; none; one key past a step
    q, table, rows = case(0, lengths, heads=20, c=48, r=16)
    fp8 = table.to(FP8)
    config = None if split is None else mla.DecodeConfig(split, -(-70 // (32 * split)) * 32)
    got = mla.mla_decode(q, fp8, rows, 0.125, 48, config=config)
    assert got[0].shape == (5, 20, 48) and got[0].dtype == torch.float32
    check(got, reference(q, fp8, rows, 0.125, 48), 1e-5)


def test_fp8_cache_with_a_scale_and_bf16_queries(mla):
    q, table, rows = case(1, [5, 64, 40], heads=16, c=64, r=16)
    fp8 = (table * 4).to(FP8)  # stored / kv_scale
    got = mla.mla_decode(q, fp8, rows, 0.1, 64, kv_scale=0.25)
    check(got, reference(q, fp8, rows, 0.1, 64, 0.25), 1e-5)
    got16 = mla.mla_decode(q.bfloat16(), fp8, rows, 0.1, 64, kv_scale=0.25)
    assert got16[0].dtype == torch.bfloat16
    check(got16, reference(q.bfloat16(), fp8, rows, 0.1, 64, 0.25), 2e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_model_dtype_cache(mla, dtype, tol):
    q, table, rows = case(2, [3, 50], heads=4, c=32, r=16)
    q, table = q.to(dtype), table.to(dtype)
    check(mla.mla_decode(q, table, rows, 0.2, 32), reference(q, table, rows, 0.2, 32), tol)


def test_decode_config_covers_every_key():
    for b, h, s in [(1, 16, 1), (1, 128, 100_000), (64, 16, 4096), (3, 20, 70)]:
        cfg = __import__(MODULE, fromlist=["x"]).decode_config(b, h, s)
        assert cfg.per_split % 32 == 0 and (cfg.split - 1) * cfg.per_split < s <= cfg.split * cfg.per_split
    assert (
        __import__(MODULE, fromlist=["x"]).decode_config(1, 16, 100_000).split > 100
    )  # a long request fills the GPU


def test_no_host_sync(mla):
    q, table, rows = case(3, [9, 40], heads=16, c=32, r=16)
    with forbid_host_sync():
        mla.mla_decode(q, table.to(FP8), rows, 0.2, 32, config=mla.DecodeConfig(2, 32))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "auto"])
def test_attend_cached_reads_the_pool_as_stored(mla, kv_cache_dtype, monkeypatch):
    """engine/attn_ops.attend_cached with the triton ops over a real pool (residue-major rows, as a
    prefill pool lays them out; a DCP rank's selected slots, -1 padded) equals the torch ops', which
    dequantize the gathered rows first; the fp8 table reaches the kernel as stored, not converted."""
    cfg = ModelConfig.from_dict(hf_config("glm_moe_dsa", "tiny"))
    pool = KVPool(cfg, 96, torch.float32, kv_cache_dtype=kv_cache_dtype, residues=2)
    g = torch.Generator().manual_seed(4)
    pool.write_kv(0, torch.arange(96), torch.randn(96, cfg.kv_entry_dim, generator=g))
    q = torch.randn(3, 8, cfg.kv_entry_dim, generator=g)
    slots = torch.stack([torch.randperm(96, generator=g)[:40] for _ in range(3)])
    valid = torch.arange(40)[None, :] < torch.tensor([[40], [7], [0]])
    seen = []
    kernel = mla.mla_decode
    monkeypatch.setattr(
        mla, "mla_decode", lambda q, table, *a: seen.append(table.dtype) or kernel(q, table, *a)
    )
    got = attend_cached(TritonOps(), pool, 0, q, slots, valid, 0.3, cfg.kv_lora_rank)
    want = attend_cached(TorchOps(), pool, 0, q.double(), slots, valid, 0.3, cfg.kv_lora_rank)
    assert seen == [pool.kv.dtype]  # float8_e4m3fn as stored
    check(got, want, 1e-5)
    dense = TritonOps().attend(q, pool.read_kv(0, slots), valid, 0.3, cfg.kv_lora_rank)  # keys [B, S, D]
    check(dense, want, 1e-5)
    shared = TritonOps().attend(q, pool.read_kv(0, slots[0]), valid, 0.3, cfg.kv_lora_rank)  # keys [S, D]
    check(
        shared,
        TorchOps().attend(q.double(), pool.read_kv(0, slots[0]).double(), valid, 0.3, cfg.kv_lora_rank),
        1e-5,
    )


def test_a_dcp_decode_step_over_an_fp8_pool(mla, tmp_path):
    """The tiny DSA model's decode step through decode_server/dcp_backend.py with an fp8 pool: the
    triton ops (the cache read as stored, the indexer's top-k rows) give the torch ops' hidden states
    (which dequantize the gathered rows) and select the same keys."""
    from pdserve.checkpoints.random_checkpoint import make_model
    from pdserve.decode_server.dcp_backend import DCPBackend, DCPGroup, DecodeBatch
    from pdserve.model.weights import load_model
    from pdserve.runtime.comm import GlooComm

    model = load_model(make_model(tmp_path / "m", "glm_moe_dsa", "tiny", seed=3), torch.float32)
    cfg, lengths = model.config, (31, 45)  # longer than the top-k of 8: the indexer selects

    def step(ops):
        pool = KVPool(cfg, 128, torch.float32, kv_cache_dtype="fp8_e4m3", scratch=True)
        g = torch.Generator().manual_seed(6)
        for layer in range(cfg.num_layers):  # the prompts' cache, as a hand-off would leave it
            index = torch.randn(128, cfg.index_head_dim, generator=g) if cfg.has_indexer(layer) else None
            pool.write(layer, torch.arange(128), torch.randn(128, cfg.kv_entry_dim, generator=g), index)
        backend = DCPBackend(cfg, pool, DCPGroup(0, 1, GlooComm(0, 1)), "copy", "a2a", False, ops)
        table = torch.zeros(len(lengths), max(lengths), dtype=torch.int32)  # pages of one slot
        for i, n in enumerate(lengths):
            table[i, :n] = torch.arange(n) + 60 * i
        backend.begin(DecodeBatch(table, torch.tensor(lengths), 1))
        pos = torch.tensor([n - 1 for n in lengths])
        with torch.inference_mode():
            return model(torch.tensor([7, 9]), pos, backend), backend.selections

    (want, want_sel), (got, got_sel) = step(TorchOps()), step(TritonOps())
    assert want_sel and all(torch.equal(got_sel[k], want_sel[k]) for k in want_sel)
    assert rel(got, want) < 1e-5


def test_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    """The variants tests/gpu/test_mla_decode_cuda.py launches, at GLM-5's dims (kv_lora 512 + rope
    64, 64 heads), compiled for sm90 on the CPU down to ptxas (triton_interp.CompileForSm90),
    within sm90's shared memory: bf16 queries over fp8 and bf16 caches, float32 over fp8."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from tests.model.triton_interp import SM90_SHARED_MAX, CompileForSm90, triton

    ptxas = __import__("pathlib").Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not ptxas.is_file():
        pytest.skip("this triton has no nvidia backend (ptxas)")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    saved = {MODULE: sys.modules.pop(MODULE, None)}
    try:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        module = importlib.import_module(MODULE)
        target = GPUTarget("cuda", 90, 32)
        backend, compiled = make_backend(target), []
        kernel = CompileForSm90(module._mla_decode_kernel, backend, target, compiled)
        monkeypatch.setattr(module, "_mla_decode_kernel", kernel)
        rows = torch.zeros(4, 2048, dtype=torch.int64)
        for q_dtype, table_dtype in (
            (torch.bfloat16, FP8),
            (torch.bfloat16, torch.bfloat16),
            (torch.float32, FP8),
        ):
            q = torch.zeros(4, 64, 576, dtype=q_dtype)
            module.mla_decode(q, torch.empty(8192, 576, dtype=table_dtype), rows, 0.04, 512)
    finally:
        _restore(saved)
    assert len(compiled) == 3
    for _, out in compiled:
        assert out.asm.get("cubin") and out.metadata.shared <= SM90_SHARED_MAX
