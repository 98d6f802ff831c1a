"""A rank that cannot hold its weights + KV + workspace refuses to start, naming the numbers, before
anything is allocated (runtime/memory_check.py, model/weights.load_model `check`)."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_server.config import DEFAULT_MAX_KV_TOKENS, DecodeServerConfig
from pdserve.decode_server.tp import shard_decode_model
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.shard import weight_bytes_by_dtype
from pdserve.model.weights import load_model
from pdserve.runtime.memory_check import (
    RankMemoryError,
    available_bytes,
    check_device_fits,
    check_gpu_memory_utilization,
    check_rank_fits,
    kv_tokens_for_memory,
)

GIB = 2**30


def test_a_rank_that_does_not_fit_is_refused_with_its_numbers():
    weights = {"float8_e4m3fn": 87 * GIB, "bfloat16": 4 * GIB, "float32": GIB // 16}
    check_rank_fits("decode rank 3", weights, 40 * GIB, 141 * GIB, "cuda:3 has", 2 * GIB)  # fits
    with pytest.raises(RankMemoryError) as e:
        check_rank_fits("decode rank 3", weights, 50 * GIB, 141 * GIB, "cuda:3 has", 2 * GIB)
    msg = str(e.value)
    for part in (
        "decode rank 3",
        "143.06 GiB",
        "weights 91.06 GiB",
        "float8_e4m3fn 87.00 GiB",
        "KV cache 50.00 GiB",
        "workspace 2.00 GiB",
        "cuda:3 has 141.00 GiB free",
    ):
        assert part in msg, (part, msg)


def test_the_check_runs_on_the_meta_model_before_any_allocation(tiny_checkpoints):
    path = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    seen = []

    def refuse(meta):
        assert all(p.is_meta for p in meta.parameters())  # nothing allocated yet
        pool = KVPool(meta.config, 1 << 40, torch.float32, "meta")  # a trillion slots: never allocated
        seen.append(weight_bytes_by_dtype(meta))
        check_device_fits("decode rank 1", torch.device("cpu"), seen[-1], pool.nbytes)

    with pytest.raises(RankMemoryError, match="decode rank 1 cannot start: .* the host has .* free"):
        load_model(path, shard=lambda m: shard_decode_model(m, 1, 2, 1, False), check=refuse)
    model = load_model(
        path,
        shard=lambda m: shard_decode_model(m, 1, 2, 1, False),
        check=lambda meta: seen.append(weight_bytes_by_dtype(meta)),
    )
    assert seen[-1] == weight_bytes_by_dtype(model)  # the meta plan is what was allocated
    assert available_bytes(torch.device("cpu"))[0] > 0


@pytest.mark.parametrize(
    "total, used, weights, workspace, utilization, page_bytes, page_size, want",
    [
        # 0.9 x 100 GiB = 90 GiB; - 1 in use - 60 weights - 2 workspace = 27 GiB = 27 * 1024 pages of 1 MiB
        (100 * GIB, GIB, 60 * GIB, 2 * GIB, 0.9, 1 << 20, 64, 27 * 1024 * 64),
        (100 * GIB, GIB, 60 * GIB, 2 * GIB, 1.0, 1 << 20, 64, 37 * 1024 * 64),
        # a partial page is dropped: 27 GiB + 1 MiB - 1 byte holds 27 * 1024 pages
        (100 * GIB, GIB - (1 << 20) + 1, 60 * GIB, 2 * GIB, 0.9, 1 << 20, 16, 27 * 1024 * 16),
        # floor(utilization * total) before the rest: 0.5 x 3 bytes = 1 byte
        (3, 0, 0, 0, 0.5, 1, 1, 1),
        # nothing left (the weights alone exceed the share): zero, never negative
        (100 * GIB, 0, 95 * GIB, 2 * GIB, 0.9, 1 << 20, 64, 0),
        (100 * GIB, 50 * GIB, 30 * GIB, 2 * GIB, 0.8, 1 << 20, 64, 0),
    ],
)
def test_kv_tokens_for_memory_table(
    total, used, weights, workspace, utilization, page_bytes, page_size, want
):
    got = kv_tokens_for_memory(total, used, weights, workspace, utilization, page_bytes, page_size)
    assert got == want
    if want:  # the pages fit the share, one more would not
        pages = got // page_size
        assert pages * page_bytes + used + weights + workspace <= utilization * total
        assert (pages + 1) * page_bytes + used + weights + workspace > utilization * total


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.01, 2, float("nan"), float("inf"), float("-inf")])
def test_gpu_memory_utilization_is_range_checked(bad):
    with pytest.raises(ValueError, match="--gpu-memory-utilization must be a number in \\(0, 1\\]"):
        check_gpu_memory_utilization(bad)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        kv_tokens_for_memory(GIB, 0, 0, 0, bad, 1, 1)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        DecodeServerConfig.create(model="m", gpu_memory_utilization=bad)
    assert check_gpu_memory_utilization(1) == 1.0 and check_gpu_memory_utilization(0.05) == 0.05


def test_the_pool_is_sized_from_memory_on_cuda_only_without_an_explicit_size():
    cpu = DecodeServerConfig.create(
        model="m", gpu_memory_utilization=0.5
    )  # accepted and ignored: today's default pool
    assert not cpu.sized_by_memory() and cpu.num_slots() == DEFAULT_MAX_KV_TOKENS
    cuda = DecodeServerConfig.create(model="m", device="cuda")
    assert cuda.sized_by_memory() and cuda.num_slots() is None
    explicit = DecodeServerConfig.create(model="m", device="cuda", max_kv_tokens=1000, page_size=64)
    assert not explicit.sized_by_memory() and explicit.num_slots() == 1024
    with pytest.raises(ValueError, match="only with --device cuda"):
        DecodeWorkerConfig("model", None)
