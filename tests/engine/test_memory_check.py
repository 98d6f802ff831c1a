"""A rank that cannot hold its weights + KV + workspace refuses to start, naming the numbers, before
anything is allocated (engine/memory_check.py, model/weights.load_model `check`)."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_server.tp import shard_decode_model
from pdserve.engine.kv_cache import KVPool
from pdserve.engine.memory_check import RankMemoryError, available_bytes, check_device_fits, check_rank_fits
from pdserve.model.shard import weight_bytes_by_dtype
from pdserve.model.weights import load_model

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
