"""One fit rule (kvcache/kv_fit.py): the router admits by it and the decode scheduler refuses by it, so
the router answers its own 400 for every request the decode would refuse and sends every request the
decode would accept. Checked at the rule's edges, then at both call sites over a grid of sizes."""

from __future__ import annotations

import itertools

import pytest

from pdserve.contracts import DecodeCapacity
from pdserve.decode_server.scheduler import DecodeRequest, DecodeScheduler
from pdserve.kvcache.kv_fit import Need, fits, kv_tokens
from pdserve.kvcache.page_allocator import PageAllocator
from pdserve.request import SamplingParams
from pdserve.router.pool import Pool, TooLong


@pytest.mark.parametrize(
    "prompt, max_tokens, n, page, capacity, ok",
    [
        (10, 7, 1, 4, 16, True),  # 16 slots (the last sampled token needs none): exactly 4 pages
        (10, 8, 1, 4, 16, False),  # one token over: a fifth page
        (1, 16, 1, 4, 16, True),  # n x (prompt + max_tokens) = 17 > 16, yet it fits exactly
        (2, 1, 4, 4, 16, True),  # n > 1, prompt shorter than a page: a whole page per choice
        (2, 1, 5, 4, 16, False),  # 5 x 3 = 15 tokens fit as tokens, not as 5 pages of 4
        (3, 2, 3, 4, 16, True),  # 4 slots per choice: one page each, 3 pages
        (4, 1, 4, 4, 16, True),  # 4 slots = exactly one page per choice
        (4, 2, 4, 4, 16, False),  # 5 slots: a second page per choice, 8 pages
        (5, 1, 2, 4, 16, True),  # 5 slots: 2 pages per choice, 4 pages
        (5, 1, 3, 4, 16, False),
        (7, 3, 2, 1, 18, True),  # page size 1: n x (prompt + max_tokens - 1) tokens
        (7, 4, 2, 1, 18, False),
        (1, 1, 1, 64, 64, True),  # one slot takes a whole page
        (1, 1, 1, 64, 63, False),  # a capacity short of a page holds nothing
    ],
)
def test_fit_rule_at_its_edges(prompt, max_tokens, n, page, capacity, ok):
    assert fits(prompt, max_tokens, n, page, capacity) is ok
    assert Need(prompt, max_tokens, n).fits(page, capacity) is ok
    assert kv_tokens(prompt, max_tokens, n, page) % page == 0


def test_sizes_must_be_positive():
    for bad in [(0, 1, 1, 4), (1, 0, 1, 4), (1, 1, 0, 4), (1, 1, 1, 0)]:
        with pytest.raises(ValueError, match="must be positive"):
            kv_tokens(*bad)


GRID = list(itertools.product(range(1, 10), range(1, 10), range(1, 6)))  # prompt, max_tokens, n
PAGES, PAGE = 6, 4  # a 24-slot instance


def _decode_accepts(prompt: int, max_tokens: int, n: int) -> bool:
    """The decode scheduler's verdict, and on an empty instance the pages it reserves."""
    alloc = PageAllocator(num_pages=PAGES, page_size=PAGE)
    sched = DecodeScheduler(alloc, eos_ids=(0,))
    req = DecodeRequest(prompt, SamplingParams(max_tokens=max_tokens, n=n))
    try:
        sched.submit(req)
    except ValueError as e:
        assert "KV slots" in str(e)
        return False
    assert sched.admit() == [req], "accepted, yet it cannot be admitted on an empty instance"
    reserved = len(req.pages) + sum(len(c.pages) for c in req.children)
    assert reserved * PAGE == kv_tokens(prompt, max_tokens, n, PAGE)
    sched.abort(req.request_id)
    assert alloc.num_free == PAGES
    return True


def _router_admits(prompt: int, max_tokens: int, n: int) -> bool:
    pool = Pool((), ("http://d1",), "round_robin")
    inst = pool.get("http://d1")
    inst.healthy = True
    total = PAGES * PAGE
    inst.info = DecodeCapacity(total_tokens=total, free_tokens=total, page_size=PAGE, queued=0)
    try:
        pool.candidates("decode", Need(prompt, max_tokens, n), admit=False)
    except TooLong as e:
        assert "more than any decode instance holds (24)" in str(e)
        return False
    return True


def test_router_admits_exactly_what_the_decode_scheduler_accepts():
    verdicts = {size: _decode_accepts(*size) for size in GRID}
    assert any(verdicts.values()) and not all(verdicts.values())
    assert {size: _router_admits(*size) for size in GRID} == verdicts
    # the cases the token count (n x (prompt + max_tokens) <= total) got wrong, both ways
    assert not verdicts[(3, 3, 4)]  # 4 x 6 = 24 tokens, but 5 slots per choice: 8 pages of 4
    assert verdicts[(1, 4, 5)]  # 5 x 5 = 25 tokens, but 4 slots per choice: 5 pages of 4


def test_router_prefers_a_decode_with_room_now_by_the_same_pages():
    pool = Pool((), ("http://d1", "http://d2"), "round_robin")
    for url, free in (("http://d1", 8), ("http://d2", 24)):
        inst = pool.get(url)
        inst.healthy = True
        inst.info = DecodeCapacity(total_tokens=24, free_tokens=free, page_size=PAGE, queued=0)
    # 3 choices of a 2-token prompt: 6 tokens, but 3 pages (12 slots): only d2 has them now
    assert [i.url for i in pool.candidates("decode", Need(2, 1, 3))] == ["http://d2"]
    assert [i.url for i in pool.candidates("decode", Need(2, 1, 2))] == ["http://d1", "http://d2"]
