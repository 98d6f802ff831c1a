"""Tenant isolation of the prefix cache (kvcache/radix_cache.py `namespace=`): a prompt never matches
pages another namespace cached, whatever their tokens; each namespace evicts and flushes like the
shared one, and an emptied namespace leaves no root behind (docs/security.md)."""

from __future__ import annotations

import random

from pdserve.kvcache.page_allocator import PageAllocator
from pdserve.kvcache.radix_cache import RadixCache

PS = 4


def make(num_pages: int = 64):
    alloc = PageAllocator(num_pages, PS)
    cache = RadixCache(PS, alloc.free)
    alloc.evictor = cache
    return alloc, cache


def cache_prompt(alloc, cache, ids: list[int], namespace: str) -> int:
    """A prefill in `namespace`: match, lock, allocate the rest, insert, unlock; the tokens it hit."""
    m = cache.match(ids[: len(ids) - 1], namespace=namespace)
    cache.lock(m.node)
    pages = m.pages + alloc.allocate(len(ids) - m.num_pages * PS)
    alloc.free(cache.insert(ids, pages, namespace))
    cache.unlock(m.node)
    return m.num_pages * PS


def test_a_prompt_never_matches_another_namespace():
    alloc, cache = make()
    ids = list(range(100, 133))  # 8 whole pages + 1
    assert cache_prompt(alloc, cache, ids, "a" * 32) == 0
    assert cache_prompt(alloc, cache, ids, "a" * 32) == 32  # within one namespace: a hit
    for other in ("", "b" * 32, "a" * 31):
        assert cache.match(ids, namespace=other).num_pages == 0, other
    assert cache_prompt(alloc, cache, ids, "b" * 32) == 0  # its own copy, in its own pages
    assert cache_prompt(alloc, cache, ids, "b" * 32) == 32
    a, b = cache.match(ids, namespace="a" * 32), cache.match(ids, namespace="b" * 32)
    assert a.num_pages == b.num_pages == 8 and not set(a.pages) & set(b.pages)
    cache.check_integrity()
    assert cache.cached_pages == 16


def pages_under(cache: RadixCache, namespace: str) -> set[int]:
    root, out = cache.roots.get(namespace), set()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        out.update(node.pages)
        stack.extend(node.children.values())
    return out


def test_namespaces_evict_and_flush_alike_and_leave_no_empty_root():
    alloc, cache = make(num_pages=16)
    rng = random.Random(0)
    namespaces = ["", "x", "y", "z"]
    for _ in range(300):  # more than fits: evictions across namespaces, never a page lost or doubled
        ns = rng.choice(namespaces)
        ids = [rng.randrange(3) for _ in range(rng.randrange(2, 20))]  # few ids: many equal prefixes
        before = pages_under(cache, ns)
        m = cache.match(ids[: len(ids) - 1], count=False, namespace=ns)
        assert set(m.pages) <= before  # a hit only ever serves this namespace's own pages
        cache_prompt(alloc, cache, ids, ns)
        cache.check_integrity()
        assert alloc.num_free + cache.cached_pages == alloc.num_pages
        owned = [pages_under(cache, n) for n in namespaces]
        assert sum(map(len, owned)) == len(set().union(*owned)) == cache.cached_pages
    cache.flush()
    assert cache.cached_pages == 0 and set(cache.roots) == {""}
