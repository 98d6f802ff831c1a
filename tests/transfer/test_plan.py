"""Packing plan of the prefill -> decode hand-off, checked by brute force against the ownership rules
(docs/design.md invariant 4): every stored row arrives exactly once from a rank that holds it, nothing
else is sent, runs are maximal, and full-storage sending is spread over all prefill ranks."""

from __future__ import annotations

import random

import pytest

from pdserve.transfer.plan import (
    DecodeSide,
    PrefillSide,
    Run,
    bytes_per_pair,
    layer_owners,
    plan_transfer,
    summary,
)

NUM_LAYERS, INDEXER = 4, (0, 2, 3)
DECODE = [(1, 1), (2, 2), (4, 2), (4, 4), (8, 8), (3, 3)]  # (W, C_d)
LENGTHS = [1, 2, 3, 7, 16, 63, 64, 65, 127, 299, 300]


def page_sizes(dcp: int) -> list[int]:
    sizes = [3, 48, 63] if dcp == 3 else [1, 16, 64]
    return [ps for ps in sizes if ps % dcp == 0]


def layouts(n: int, page_size: int, seed) -> tuple[list[int], list[int]]:
    """Random prefill slots (shuffled 16-slot prefill pages) and shuffled decode pages. Ids come
    from a range only ~2x the need, so some neighbours are consecutive and runs cross pages."""
    rng = random.Random(seed)
    k = -(-n // 16)
    pre_pages = rng.sample(range(2 * k + 2), k)
    slots = [pre_pages[p // 16] * 16 + p % 16 for p in range(n)]
    m = -(-n // page_size) + rng.randint(0, 1)  # sometimes a spare page the plan must ignore
    return slots, rng.sample(range(2 * m + 2), m)


def expected_rows(pre: PrefillSide, dec: DecodeSide, n: int) -> dict[tuple, int]:
    """{(dst_rank, layer, kind, dst_row): src_row}, straight from the ownership rules."""
    W, C, ps = dec.tp_size, dec.dcp_size, dec.page_size
    out: dict[tuple, int] = {}
    for p in range(n):
        s = dec.pages[p // ps] * ps + p % ps
        owners = [g * C + s % C for g in range(W // C)]  # one per DCP group
        for layer in range(pre.num_layers):
            keys = [(d, layer, "kv", s // C) for d in owners]
            if layer in pre.indexer_layers:
                if dec.index_mode == "copy":
                    keys += [(d, layer, "index", s) for d in range(W)]
                else:
                    keys += [(d, layer, "index", s // C) for d in owners]
            for key in keys:
                assert key not in out
                out[key] = pre.slots[p]
    return out


def check_plan(plan, pre: PrefillSide, expected: dict[tuple, int]) -> None:
    keys = [(t.src_rank, t.dst_rank, t.layer, t.kind) for t in plan]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # one Transfer per key, sorted
    got: dict[tuple, int] = {}
    total = 0
    for t in plan:
        assert 0 <= t.src_rank < pre.cp_size and pre.holds(t.src_rank, t.layer)
        assert t.runs and all(r.length >= 1 for r in t.runs)
        # (c) greedy-maximal: a run's first row could not have extended the run before it
        for prev, r in zip(t.runs, t.runs[1:]):
            assert prev.src_rows()[-1] < r.src, t  # ascending source rows
            joinable = prev.dst + prev.length == r.dst and (
                prev.length == 1 or prev.src_rows()[-1] + prev.step == r.src
            )
            assert not joinable, (prev, r)
        for r in t.runs:
            assert r.step >= 1
            total += r.length
            for i, src in enumerate(r.src_rows()):
                got[t.dst_rank, t.layer, t.kind, r.dst + i] = src
    assert total == len(got)  # (a) nothing received twice
    assert got == expected  # (a) every expected row, from the right source row; (b) nothing else


def check_balance(plan, cp_size: int) -> None:
    """(d) full storage: every prefill rank sends when it can, and no rank sends > 2x the average."""
    sent = [0] * cp_size
    for t in plan:
        sent[t.src_rank] += t.rows
    if len({(t.layer, t.dst_rank) for t in plan}) >= cp_size:
        assert min(sent) > 0, sent
    assert max(sent) <= 2 * sum(sent) / cp_size, sent


def run_all(W, C, page_size, index_mode, n, seed, cp_sizes=(1, 2, 3, 4), caches=("full", "layer-split")):
    slots, pages = layouts(n, page_size, seed)
    dec = DecodeSide(W, C, index_mode, page_size, tuple(pages))
    expected = expected_rows(PrefillSide(1, "full", NUM_LAYERS, INDEXER, tuple(slots)), dec, n)
    for cp in cp_sizes:
        for cache in caches:
            pre = PrefillSide(cp, cache, NUM_LAYERS, INDEXER, tuple(slots))
            plan = plan_transfer(pre, dec, n)
            check_plan(plan, pre, expected)
            if cache == "full" and cp > 1:
                check_balance(plan, cp)


CROSS = [(W, C, ps) for W, C in DECODE for ps in page_sizes(C)]


@pytest.mark.parametrize("index_mode", ["copy", "split"])
@pytest.mark.parametrize("W,C,page_size", CROSS)
def test_brute_force_cross_product(W, C, page_size, index_mode):
    for n in LENGTHS:
        run_all(W, C, page_size, index_mode, n, seed=f"{W}/{C}/{page_size}/{index_mode}/{n}")


@pytest.mark.parametrize(
    "W,C,page_size,index_mode,cp,cache",
    [
        (4, 2, 16, "copy", 3, "full"),
        (3, 3, 48, "split", 2, "layer-split"),
        (1, 1, 1, "copy", 4, "full"),
    ],
)
def test_brute_force_every_length(W, C, page_size, index_mode, cp, cache):
    for n in range(1, 301):
        run_all(W, C, page_size, index_mode, n, seed=n, cp_sizes=(cp,), caches=(cache,))


def test_contiguous_pages_give_few_runs():
    n, slots, pages = 100, tuple(range(100, 200)), tuple(range(3, 10))  # decode slots 48..147
    pre = PrefillSide(1, "full", 2, (1,), slots)
    plan = plan_transfer(pre, DecodeSide(2, 1, "copy", 16, pages), n)  # 2 groups of 1 rank
    assert len(plan) == 6 and all(t.runs == (Run(100, 48, n),) for t in plan)
    # C_d = 2: kv rows of one rank are every other position: one run of source step 2 each;
    # the copied index keeps the global slot as its row, so it stays a single run of step 1.
    plan = plan_transfer(pre, DecodeSide(2, 2, "copy", 16, pages), n)
    assert [len(t.runs) for t in plan if t.kind == "index"] == [1, 1]
    assert [t.runs for t in plan if t.kind == "kv"] == [(Run(100, 24, 50, 2),)] * 2 + [
        (Run(101, 24, 50, 2),)
    ] * 2
    assert summary(plan) == {"transfers": 6, "runs": 6, "kv_rows": 200, "index_rows": 200}
    # layer-split over 2 prefill ranks: each layer comes from its owner
    pre2 = PrefillSide(2, "layer-split", 2, (1,), slots)
    plan = plan_transfer(pre2, DecodeSide(2, 1, "split", 16, pages), n)
    assert [(t.src_rank, t.dst_rank, t.layer, t.kind) for t in plan] == [
        (0, 0, 0, "kv"),
        (0, 1, 0, "kv"),
        (1, 0, 1, "index"),
        (1, 0, 1, "kv"),
        (1, 1, 1, "index"),
        (1, 1, 1, "kv"),
    ]
    assert all(t.runs == (Run(100, 48, n),) for t in plan)


def test_layer_split_rank_without_layers_and_single_layer():
    slots, pages = layouts(50, 16, seed=7)
    for layers, cp in [(3, 4), (1, 3)]:  # some prefill ranks own no layer at all
        pre = PrefillSide(cp, "layer-split", layers, (0,), tuple(slots))
        dec = DecodeSide(4, 2, "split", 16, tuple(pages))
        check_plan(plan_transfer(pre, dec, 50), pre, expected_rows(pre, dec, 50))


def test_sizes_and_helpers():
    pre = PrefillSide(1, "full", 1, (0,), (0, 1, 2, 3))
    plan = plan_transfer(pre, DecodeSide(2, 2, "copy", 2, (0, 1)), 4)
    assert bytes_per_pair(plan, kv_row_bytes=1152, index_row_bytes=132) == {
        (0, 0): 2 * 1152 + 4 * 132,
        (0, 1): 2 * 1152 + 4 * 132,
    }
    assert summary(plan) == {
        "transfers": 4,
        "runs": 4,
        "kv_rows": 4,
        "index_rows": 8,
    }  # kv: one run of step 2 each
    assert plan_transfer(pre, DecodeSide(2, 2, "copy", 2, (0, 1)), 4) == plan  # deterministic
    assert plan_transfer(pre, DecodeSide(2, 2, "copy", 2, ()), 0) == []
    assert summary([]) == {"transfers": 0, "runs": 0, "kv_rows": 0, "index_rows": 0}


def test_layer_owners_match_prefill_backend():
    from pdserve.prefill_server.cp_backend import layer_owners as backend_owners  # imports torch

    for layers in range(1, 13):
        for cp in range(1, 10):
            assert layer_owners(layers, cp) == backend_owners(layers, cp)


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: DecodeSide(4, 3, "copy", 3, (0,)), "must divide"),
        (lambda: DecodeSide(4, 2, "copy", 3, (0,)), "multiple of dcp_size"),
        (lambda: DecodeSide(2, 2, "shard", 2, (0,)), "unknown index mode"),
        (lambda: PrefillSide(2, "sharded", 2, (), (0,)), "unknown prefill cache mode"),
        (lambda: PrefillSide(2, "full", 2, (2,), (0,)), "indexer_layers"),
        (lambda: PrefillSide(0, "full", 2, (), (0,)), "cp_size"),
        (
            lambda: plan_transfer(
                PrefillSide(1, "full", 1, (), (0, 1)), DecodeSide(1, 1, "copy", 1, (0, 1)), 3
            ),
            "slots",
        ),
        (
            lambda: plan_transfer(
                PrefillSide(1, "full", 1, (), (0, 1, 2)), DecodeSide(1, 1, "copy", 2, (0,)), 3
            ),
            "pages",
        ),
        (
            lambda: plan_transfer(
                PrefillSide(1, "full", 1, (), (0, 0)), DecodeSide(1, 1, "copy", 2, (0,)), 2
            ),
            "distinct",
        ),
        (
            lambda: plan_transfer(
                PrefillSide(1, "full", 1, (), (0, 1)), DecodeSide(1, 1, "copy", 1, (4, 4)), 2
            ),
            "distinct",
        ),
        (
            lambda: plan_transfer(PrefillSide(1, "full", 1, (), ()), DecodeSide(1, 1, "copy", 1, ()), -1),
            ">= 0",
        ),
    ],
)
def test_invalid_inputs(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("W,C", [(1, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("index_mode", ["copy", "split"])
def test_a_cached_prefix_on_the_decode_side_is_not_sent(W, C, index_mode):
    """start = the decode instance's cached whole pages: exactly the rows of positions >= start go,
    each to the rank and row of the full plan (cached rows stay where slot s % C_d puts them)."""
    n, ps = 45, 4
    slots, pages = layouts(n, ps, f"{W}-{C}-{index_mode}")
    prefill, decode = (
        PrefillSide(2, "full", NUM_LAYERS, INDEXER, slots),
        DecodeSide(W, C, index_mode, ps, pages),
    )

    def rows(plan):  # (dst rank, layer, kind, dst row, src slot)
        return {
            (t.dst_rank, t.layer, t.kind, r.dst + i, s)
            for t in plan
            for r in t.runs
            for i, s in enumerate(r.src_rows())
        }

    full = rows(plan_transfer(prefill, decode, n))
    for start in (4, 20, 44):
        sent = rows(plan_transfer(prefill, decode, n, start))
        kept = {slots[p] for p in range(start, n)}
        assert sent == {row for row in full if row[4] in kept}, start
    assert plan_transfer(prefill, decode, 4, 4) == []
    for bad in (3, 48):
        with pytest.raises(ValueError):
            plan_transfer(prefill, decode, n, bad)
