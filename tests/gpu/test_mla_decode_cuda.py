"""The triton MLA decode kernel (model/triton_mla_decode.py) compiled for this GPU, at GLM-5's MLA dims
(kv_lora 512 + rope 64, 64 heads of a DCP group), reading an fp8 (e4m3) cache as stored, against the
torch reference: the cache dequantized, gathered and attended in float64 (model/kernels.attend).
Requests of 1, 100, 2049 and 4113 keys (not multiples of the 32-key step), selected rows in random
order (a DSA top-k of 2048 among 8192), one request with no key (lse -inf, out 0).
Tolerances (relative to the reference's norm): float32 queries 1e-4 (ieee dots), bf16 2e-2 (bf16
probabilities). Sync-freedom under torch.cuda.set_sync_debug_mode("error"); a CUDA graph replays the
eager result bit for bit. Also: `auto` picks the triton ops for an fp8 cache here (capability 8.9+),
and a decode instance without a pool size takes its KV tokens from --gpu-memory-utilization.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attn_ops import make_attention_ops
from pdserve.model.config import ModelConfig
from pdserve.model.kernels import attend
from pdserve.model.triton_mla_decode import mla_decode

CUDA = torch.device("cuda", 0)
C, R, HEADS, N = 512, 64, 64, 8192
LENGTHS = [1, 100, 0, 2049, 4113]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.fixture(scope="module")
def case():
    g = torch.Generator(CUDA).manual_seed(0)
    table = (torch.randn(N, C + R, device=CUDA, generator=g) * 2).to(torch.float8_e4m3fn)
    q = torch.randn(len(LENGTHS), HEADS, C + R, device=CUDA, generator=g) * 0.05
    rows = torch.full((len(LENGTHS), max(LENGTHS)), -1, dtype=torch.int64, device=CUDA)
    for b, n in enumerate(LENGTHS):
        rows[b, :n] = torch.randperm(N, device=CUDA, generator=g)[:n]
    return q, table, rows


def reference(q, table, rows, scale):
    keys = table.double()[rows.clamp(min=0)]
    return attend(q.double(), keys, rows >= 0, scale, C)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_fp8_cache_against_float64(case, dtype, tol):
    q, table, rows = case
    q = q.to(dtype)
    out, lse = mla_decode(q, table, rows, 0.0417, C)
    want_out, want_lse = reference(q, table, rows, 0.0417)
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty) and (out[2] == 0).all()
    assert rel(out, want_out) < tol and rel(lse[~empty], want_lse[~empty]) < tol


def test_no_sync_and_cuda_graph(case):
    q, table, rows = case
    q = q.bfloat16()
    eager = mla_decode(q, table, rows, 0.0417, C)  # compiles
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode(q, table, rows, 0.0417, C)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_decode(q, table, rows, 0.0417, C)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])


def test_auto_picks_triton_for_an_fp8_cache(mla):
    if torch.cuda.get_device_capability(CUDA) < (8, 9):
        pytest.skip("fp8 tiles need compute capability 8.9")
    ops = make_attention_ops("auto", CUDA, torch.bfloat16, ModelConfig.from_pretrained(mla), "fp8_e4m3")
    assert ops.name == "triton"


def test_pool_sized_by_gpu_memory_utilization(tiny):
    from pdserve.decode_server.instance import DecodeInstance
    from pdserve.decode_server.worker_config import DecodeWorkerConfig
    from pdserve.runtime.launcher import LaunchConfig
    from tests.reference import free_port

    worker = DecodeWorkerConfig(tiny, None, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3)
    total = torch.cuda.mem_get_info(CUDA)[1]
    with DecodeInstance(worker, LaunchConfig(1, free_port(), device="cuda"), page_size=64) as inst:
        slots = inst.rank_infos[0].num_slots
        assert slots > 0 and slots % 64 == 0
        assert inst.allocator.num_pages * inst.allocator.page_size == slots
        assert inst.rank_infos[0].cache_bytes <= 0.3 * total
