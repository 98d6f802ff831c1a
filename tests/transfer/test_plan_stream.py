"""The plan of a streamed hand-off (transfer/plan.py plan_stream): its segments together carry
exactly the rows of the unstreamed plan, each from the same prefill rank; a segment carries only
the rows of its positions; the cuts are where the prefill's chunks begin."""

from __future__ import annotations

import pytest

from pdserve.transfer.plan import DecodeSide, PrefillSide, plan_stream, plan_transfer
from tests.transfer.test_plan import INDEXER, NUM_LAYERS, layouts


def rows(plan) -> dict[tuple, int]:
    """{(dst rank, layer, kind, dst row): (src rank, src slot)}; a row sent twice fails."""
    out: dict[tuple, int] = {}
    for t in plan:
        for r in t.runs:
            for i, s in enumerate(r.src_rows()):
                key = (t.dst_rank, t.layer, t.kind, r.dst + i)
                assert key not in out, key
                out[key] = (t.src_rank, s)
    return out


@pytest.mark.parametrize("cp,cache", [(1, "full"), (3, "full"), (2, "layer-split"), (4, "layer-split")])
@pytest.mark.parametrize("W,C,index_mode", [(1, 1, "copy"), (2, 2, "split"), (4, 2, "copy")])
def test_segments_carry_the_plan(cp, cache, W, C, index_mode):
    n, ps = 53, 4
    slots, pages = layouts(n, ps, f"{cp}{cache}{W}{C}")
    pre = PrefillSide(cp, cache, NUM_LAYERS, INDEXER, slots)
    dec = DecodeSide(W, C, index_mode, ps, pages)
    position_of = {s: p for p, s in enumerate(slots)}
    for start, bounds in [(0, [0, 16, 32, 48]), (0, [5, 6, 7]), (8, [0, 3, 13]), (8, [20]), (0, [])]:
        plan, segments = plan_stream(pre, dec, n, start, bounds)
        want = rows(plan_transfer(pre, dec, n, start))
        assert rows(plan) == want, (start, bounds)  # the same rows, each from the same rank
        cuts = [start] + [b for b in bounds if start < b < n] + [n]
        assert [(s.first, s.end) for s in segments] == list(zip(cuts, cuts[1:]))
        assert segments[0].lo == 0 and segments[-1].hi == len(plan)
        for seg, nxt in zip(segments, segments[1:]):
            assert seg.hi == nxt.lo
        for seg in segments:
            for _, s in rows(plan[seg.lo : seg.hi]).values():
                assert seg.first <= position_of[s] < seg.end, seg
    assert plan_stream(pre, dec, 8, 8, [0, 4]) == ([], [])


def test_bad_bounds_and_start_are_refused():
    slots, pages = layouts(20, 4, "bad")
    pre, dec = PrefillSide(2, "full", 2, (), slots), DecodeSide(2, 2, "copy", 4, pages)
    for bounds in ([8, 4], [4, 4]):
        with pytest.raises(ValueError, match="ascend"):
            plan_stream(pre, dec, 20, 0, bounds)
    with pytest.raises(ValueError, match="multiple of the page size"):
        plan_stream(pre, dec, 20, 3, [0])
