"""KV bookkeeping: an integer page allocator, separate from the tensors that hold the cache.

A page is `page_size` consecutive slots; slot s of page p is p * page_size + s.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, clock: Callable[[], float] = time.monotonic):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.clock = clock  # when held pages come back (free's hold_s)
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()
        self._held: list[tuple[float, list[int]]] = []  # (until, pages): freed, not yet reusable
        # A prefix cache (kvcache/radix_cache.py) whose unreferenced pages count as available: when
        # the free list runs short, allocate() asks it to evict (it frees them back here).
        self.evictor = None

    @property
    def num_free(self) -> int:
        self._reclaim()
        return len(self._free)

    @property
    def num_held(self) -> int:
        self._reclaim()
        return sum(len(pages) for _, pages in self._held)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_available(self) -> int:
        """Free pages plus the ones a prefix cache would evict on demand."""
        return self.num_free + (self.evictor.evictable_pages if self.evictor is not None else 0)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_available

    def allocate(self, num_tokens: int) -> list[int]:
        self._reclaim()
        n = self.pages_for(num_tokens)
        if n > len(self._free) and self.evictor is not None:
            self.evictor.evict(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages for {num_tokens} tokens, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int], hold_s: float = 0.0) -> None:
        """Returns pages; with hold_s > 0 they become reusable only hold_s seconds from now (pages a
        peer may still WRITE into: a hand-off that failed while its senders could still be sending)."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free?)")
        self._used.difference_update(pages)
        if hold_s > 0:
            self._held.append((self.clock() + hold_s, list(pages)))
        else:
            self._free.extend(pages)

    def _reclaim(self) -> None:
        if self._held:
            now = self.clock()
            for _, pages in (h for h in self._held if h[0] <= now):
                self._free.extend(pages)
            self._held = [h for h in self._held if h[0] > now]

    def check_integrity(self) -> None:
        free = set(self._free)
        held = {p for _, pages in self._held for p in pages}
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not (free & self._used) and not (held & (free | self._used)), "a page is in two states"
        assert free | self._used | held == set(range(self.num_pages)), "a page is lost"

    def slots(self, pages: list[int], start: int, end: int) -> list[int]:
        """Slots holding token positions [start, end) of a request that owns `pages`."""
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]
