"""The rotary table a non-CPU device reads holds, bit for bit, what the CPU path computes for the
same positions (so a GPU's float64 run sees the CPU's float32 cos/sin, see model/rope.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.config import RopeConfig
from pdserve.model.rope import RotaryEmbedding


def test_table_rows_equal_the_direct_computation():
    for rope in (
        RopeConfig("default", 10000.0, 64),
        RopeConfig(
            "yarn",
            10000.0,
            64,
            factor=40.0,
            original_max_position_embeddings=4096,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ):
        emb = RotaryEmbedding(rope, max_positions=5000)
        cos_t, sin_t = emb._table(torch.device("cpu"))
        assert cos_t.shape == (5000, 32)
        positions = torch.tensor([4999, 0, 7, 1234, 3, 4096, 2047])
        cos, sin = emb(positions, torch.float64)
        assert torch.equal(cos_t[positions].double(), cos) and torch.equal(sin_t[positions].double(), sin)


def test_table_needs_max_positions():
    emb = RotaryEmbedding(RopeConfig("default", 10000.0, 64))
    with pytest.raises(ValueError, match="max_positions"):
        emb._table(torch.device("cpu"))
