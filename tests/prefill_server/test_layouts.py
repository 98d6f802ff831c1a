"""Prefill context-parallel layouts: token ownership and the work balance from the article's section 2
(Figure 5: contiguous / zigzag / interleave on 16 tokens and 4 GPUs; 2.2's 2C-1 factor; 2.3's 2C
block units; 2.4's ~0.01% at 128,000 tokens on 8 GPUs)."""

from __future__ import annotations

import pytest

from pdserve.prefill_server.layouts import (
    LAYOUTS,
    balance,
    check_layout_allowed,
    pair_counts,
    recommended_layout,
    split_positions,
    zigzag_block_units,
)

SPARSE = ("glm_moe_dsa", "deepseek_v32")


# ---- split_positions --------------------------------------------------------------------------

RANGES = [
    (0, 0),
    (7, 7),
    (0, 1),
    (0, 3),
    (2, 5),
    (0, 16),
    (3, 19),
    (5, 6),
    (10, 17),
    (0, 37),
    (13, 50),
    (1, 101),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("start,end", RANGES)
def test_split_is_a_partition(layout, cp_size, start, end):
    parts = split_positions(layout, start, end, cp_size)
    assert len(parts) == cp_size
    for pos in parts:
        assert pos == sorted(pos) and len(set(pos)) == len(pos)
    flat = [p for pos in parts for p in pos]
    assert sorted(flat) == list(range(start, end))  # every position exactly once, nothing outside


@pytest.mark.parametrize("start,end", RANGES)
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 5])
def test_interleave_uses_absolute_position(start, end, cp_size):
    parts = split_positions("interleave", start, end, cp_size)
    for r, pos in enumerate(parts):
        assert all(p % cp_size == r for p in pos)


def test_interleave_chunk_not_starting_at_multiple_of_c():
    assert split_positions("interleave", 5, 13, 3) == [[6, 9, 12], [7, 10], [5, 8, 11]]
    # Two consecutive chunks give the same ownership as one chunk over both.
    a = split_positions("interleave", 0, 7, 4)
    b = split_positions("interleave", 7, 20, 4)
    assert [x + y for x, y in zip(a, b)] == split_positions("interleave", 0, 20, 4)


def test_zigzag_figure():
    assert split_positions("zigzag", 0, 16, 2) == [[0, 1, 2, 3, 12, 13, 14, 15], list(range(4, 12))]
    assert split_positions("zigzag", 0, 16, 4) == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    # Relative to the chunk: a chunk after a cached prefix is cut the same way, shifted.
    assert split_positions("zigzag", 100, 116, 2) == [
        [100, 101, 102, 103, 112, 113, 114, 115],
        list(range(104, 112)),
    ]


def test_contiguous_pieces():
    assert split_positions("contiguous", 0, 16, 4) == [list(range(4 * r, 4 * r + 4)) for r in range(4)]
    assert split_positions("contiguous", 0, 10, 4) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fewer_tokens_than_ranks(layout):
    parts = split_positions(layout, 3, 5, 4)
    assert sorted(p for pos in parts for p in pos) == [3, 4]
    assert sum(1 for pos in parts if not pos) == 2
    assert split_positions(layout, 9, 9, 3) == [[], [], []]


# ---- pair accounting ---------------------------------------------------------------------------


def test_figure5_contiguous_58_vs_10():
    counts = pair_counts("contiguous", 16, 4)
    assert counts == [10, 26, 42, 58]  # "GPU 3 ends up with 58 pairs and GPU 0 with 10"
    assert counts[-1] / counts[0] == pytest.approx(5.8)


def test_figure5_zigzag_and_interleave():
    assert pair_counts("zigzag", 16, 4) == [34, 34, 34, 34]
    assert pair_counts("interleave", 16, 4) == [28, 32, 36, 40]
    for layout in LAYOUTS:
        assert sum(pair_counts(layout, 16, 4)) == 16 * 17 // 2


@pytest.mark.parametrize("cp_size", range(1, 9))
def test_zigzag_block_units_are_2c(cp_size):
    assert zigzag_block_units(cp_size) == [2 * cp_size] * cp_size


@pytest.mark.parametrize("cp_size", range(1, 9))
@pytest.mark.parametrize("blocks_of", [1, 2, 3, 7])
@pytest.mark.parametrize("start", [0, 5, 1000])
def test_zigzag_pairs_exactly_equal_when_2c_divides_n(cp_size, blocks_of, start):
    # Exact, not just in block units: block b of s tokens costs b*s^2 + s(s+1)/2 (+ s*start for a
    # cached prefix), and the r-dependence still cancels: 2C*s^2 + s (+ 2s*start) per rank.
    s = blocks_of
    counts = pair_counts("zigzag", 2 * cp_size * s, cp_size, start=start)
    assert counts == [2 * cp_size * s * s + s + 2 * s * start] * cp_size


@pytest.mark.parametrize(
    "n,cp_size", [(1001, 8), (999, 3), (128_003, 8), (130, 4), (100, 8), (17, 4), (9, 4)]
)
def test_zigzag_nearly_equal_otherwise(n, cp_size):
    # Uneven blocks differ by one token; one extra late token costs ~n pairs against ~n^2/(2C) per
    # rank, so the imbalance is below 2C/n = 1/(block size): tiny for real chunk sizes.
    assert balance("zigzag", n, cp_size) < 1 + 2 * cp_size / n
    if n > 100_000:
        assert balance("zigzag", n, cp_size) < 1.0001


def test_interleave_128k_8_ranks_within_001_percent():
    counts = pair_counts("interleave", 128_000, 8)
    assert counts == sorted(counts)  # each rank reads one more key per query than the previous one
    assert balance("interleave", 128_000, 8) == pytest.approx(1.0000546870727574, rel=1e-12)
    assert balance("interleave", 128_000, 8) < 1.0001  # busiest within 0.01% of the average
    assert counts[-1] / counts[0] - 1 < 0.00011  # and ~0.011% above the least busy rank


def test_contiguous_128k_8_ranks_close_to_2c_minus_1():
    counts = pair_counts("contiguous", 128_000, 8)
    assert counts[-1] / counts[0] == pytest.approx(15, rel=1e-3)  # 14.99913
    assert balance("contiguous", 128_000, 8) == pytest.approx(1.875, rel=1e-3)  # ~ (2C-1)/C


def test_balance_edge_cases():
    assert balance("contiguous", 0, 4) == 1.0
    assert balance("zigzag", 3, 1) == 1.0
    assert pair_counts("interleave", 0, 3) == [0, 0, 0]
    # Cached prefix: queries at 10..13 read 11..14 keys.
    assert pair_counts("contiguous", 4, 2, start=10) == [11 + 12, 13 + 14]


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["stripe", "Zigzag", ""])
def test_bad_layout_name(bad):
    with pytest.raises(ValueError) as e:
        split_positions(bad, 0, 4, 2)
    assert repr(bad) in str(e.value)
    assert all(name in str(e.value) for name in LAYOUTS)
    with pytest.raises(ValueError):
        check_layout_allowed("deepseek_v3", bad)


@pytest.mark.parametrize("bad", [0, -1, True])
def test_bad_cp_size(bad):
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        split_positions("interleave", 0, 4, bad)
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        zigzag_block_units(bad)


def test_bad_range():
    with pytest.raises(ValueError):
        split_positions("zigzag", 5, 4, 2)
    with pytest.raises(ValueError):
        split_positions("zigzag", -1, 4, 2)
    with pytest.raises(ValueError):
        pair_counts("zigzag", -1, 2)


@pytest.mark.parametrize("model_type", SPARSE)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_sparse_models_reject_non_interleave(model_type, layout):
    with pytest.raises(ValueError) as e:
        check_layout_allowed(model_type, layout)
    msg = str(e.value)
    assert f"--cp-layout {layout}" in msg and model_type in msg and "interleave" in msg


@pytest.mark.parametrize("model_type", SPARSE)
def test_sparse_models_accept_interleave(model_type):
    check_layout_allowed(model_type, "interleave")
    assert recommended_layout(model_type) == "interleave"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_model_accepts_every_layout(layout):
    check_layout_allowed("deepseek_v3", layout)


def test_dense_model_recommends_zigzag():
    assert recommended_layout("deepseek_v3") == "zigzag"


def test_unknown_model_type():
    with pytest.raises(ValueError, match="llama"):
        check_layout_allowed("llama", "interleave")
