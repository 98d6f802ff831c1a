"""The prefix cache's radix tree (kvcache/radix_cache.py) over the production PageAllocator: page
granularity, reference counts, LRU eviction of unreferenced leaves, and no page ever lost or doubled
(docs/design.md invariant 7), including a randomized model check against a brute-force oracle."""

from __future__ import annotations

import random

import pytest

from pdserve.kvcache.page_allocator import OutOfPages, PageAllocator
from pdserve.kvcache.radix_cache import RadixCache

PS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def make(num_pages: int = 64, ps: int = PS):
    alloc = PageAllocator(num_pages, ps)
    cache = RadixCache(ps, alloc.free, clock=Clock())
    alloc.evictor = cache
    return alloc, cache


def compute(alloc: PageAllocator, cache: RadixCache, ids: list[int]):
    """What a prefill does: match (at most len - 1 tokens), lock, allocate the rest."""
    m = cache.match(ids[: len(ids) - 1])
    cache.lock(m.node)
    try:
        pages = m.pages + alloc.allocate(len(ids) - m.num_pages * cache.page_size)
    except OutOfPages:
        cache.unlock(m.node)
        raise
    return m, pages


def finish(alloc: PageAllocator, cache: RadixCache, ids: list[int], m, pages: list[int]) -> None:
    """What a release does: insert the whole pages, free the rest, unlock."""
    alloc.free(cache.insert(ids, pages))
    cache.unlock(m.node)


def check(alloc: PageAllocator, cache: RadixCache, held: int = 0) -> None:
    alloc.check_integrity()
    cache.check_integrity()
    assert alloc.num_pages - alloc.num_free == cache.cached_pages + held


def test_match_is_page_granular_and_reuses_pages():
    alloc, cache = make()
    ids = list(range(10))  # 2 full pages + 2 tokens
    m, pages = compute(alloc, cache, ids)
    assert m.pages == [] and len(pages) == 3
    finish(alloc, cache, ids, m, pages)
    assert cache.cached_pages == 2 and cache.evictable_pages == 2
    check(alloc, cache)
    # same first 9 tokens, mid-page divergence: 2 pages reused, nothing for the partial page
    m2 = cache.match(ids[:9] + [99])
    assert m2.pages == pages[:2]
    assert cache.match(ids[:7]).pages == pages[:1]  # stops at the last whole page matched
    assert cache.match([1] + ids[1:]).pages == []
    assert cache.hit_tokens == 8 + 4


def test_whole_prompt_on_a_page_boundary_keeps_one_token_to_compute():
    alloc, cache = make()
    ids = list(range(8))
    m, pages = compute(alloc, cache, ids)
    finish(alloc, cache, ids, m, pages)
    m, pages2 = compute(alloc, cache, ids)  # the whole prompt is cached: match only len - 1
    assert m.num_pages == 1 and pages2[0] == pages[0] and pages2[1] != pages[1]
    finish(alloc, cache, ids, m, pages2)  # the recomputed last page is a duplicate: freed
    assert cache.cached_pages == 2
    check(alloc, cache)


def test_split_on_divergence_and_lru_eviction_of_leaves():
    alloc, cache = make(num_pages=8)
    a = list(range(12))  # 3 pages
    b = list(range(8)) + [50, 51, 52, 53]  # shares 2 pages with a
    for ids in (a, b):
        m, pages = compute(alloc, cache, ids + [7])
        finish(alloc, cache, ids + [7], m, pages)
    assert cache.cached_pages == 4  # 2 shared + 1 + 1
    check(alloc, cache)
    cache.match(a)  # a is now the most recently used
    assert cache.evict(1) == 1  # b's leaf goes first
    assert cache.match(b, count=False).num_pages == 2 and cache.match(a, count=False).num_pages == 3
    assert cache.evict(2) == 3  # a's leaf, then the shared parent that became a leaf
    assert cache.cached_pages == 0 and alloc.num_free == 8
    check(alloc, cache)


def test_locked_pages_are_never_evicted():
    alloc, cache = make(num_pages=4)
    ids = list(range(12))
    m, pages = compute(alloc, cache, ids)
    finish(alloc, cache, ids, m, pages)
    m, pages = compute(alloc, cache, ids)  # locks 2 of the 3 cached pages
    assert m.num_pages == 2 and cache.protected_pages == 2 and cache.evictable_pages == 1
    assert alloc.num_available == 1 and cache.flush() == 1  # 4 pages: 2 locked, 1 new, 1 evicted
    with pytest.raises(OutOfPages):
        alloc.allocate(2 * PS)  # 1 free, nothing evictable
    assert cache.cached_pages == 2
    finish(alloc, cache, ids, m, pages)
    check(alloc, cache)
    assert cache.flush() == 3 and cache.cached_pages == 0 and cache.evicted_pages == 4
    assert alloc.num_free == 4


def test_allocator_evicts_on_demand_and_counts_evictable_as_available():
    alloc, cache = make(num_pages=6)
    for base in (0, 100, 200):
        ids = list(range(base, base + 8))
        m, pages = compute(alloc, cache, ids)
        finish(alloc, cache, ids, m, pages)
    assert alloc.num_free == 0 and alloc.num_available == 6 and alloc.can_allocate(6 * PS)
    cache.match(list(range(8)))  # the first prompt becomes the most recent
    got = alloc.allocate(4 * PS)
    assert len(got) == 4 and cache.match(list(range(8)), count=False).num_pages == 2
    alloc.free(got)
    check(alloc, cache)


def test_unlock_without_lock_and_short_pages_raise():
    alloc, cache = make()
    ids = list(range(8))
    m, pages = compute(alloc, cache, ids)
    finish(alloc, cache, ids, m, pages)
    node = cache.match(ids).node
    with pytest.raises(ValueError):
        cache.unlock(node)
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), [1])
    with pytest.raises(ValueError):
        RadixCache(0, alloc.free)


def test_randomized_against_a_brute_force_oracle():
    """Random prompts over a small alphabet (lots of sharing), concurrent holders, evictions:
    every match equals the longest page-aligned prefix among the cached prompts, the pages it
    returns hold exactly those tokens, and nothing leaks."""
    rng = random.Random(0)
    alloc, cache = make(num_pages=40)
    content: dict[int, tuple[int, ...]] = {}  # page -> the tokens written into it
    live = []
    for step in range(600):
        if live and (rng.random() < 0.5 or len(live) > 4):
            ids, m, pages = live.pop(rng.randrange(len(live)))
            finish(alloc, cache, ids, m, pages)
        else:
            ids = [rng.choice([1, 2]) for _ in range(rng.randint(1, 24))]
            try:
                m, pages = compute(alloc, cache, ids)
            except OutOfPages:
                continue
            for i, p in enumerate(m.pages):
                assert content[p] == tuple(ids[i * PS : (i + 1) * PS]), f"step {step}: wrong page"
            for i, p in enumerate(pages[m.num_pages :], m.num_pages):
                content[p] = tuple(ids[i * PS : (i + 1) * PS])
            live.append((ids, m, pages))
        if rng.random() < 0.05:
            cache.flush()
        check(alloc, cache, held=sum(len(p) - m.num_pages for _, m, p in live))
    for ids, m, pages in live:
        finish(alloc, cache, ids, m, pages)
    cache.flush()
    assert cache.cached_pages == 0 and alloc.num_free == 40
    check(alloc, cache)
