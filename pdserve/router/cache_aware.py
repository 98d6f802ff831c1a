"""The `cache_aware` policy's model of what each instance's prefix cache holds (torch-free).

The router never sees the instances' radix trees (kvcache/radix_cache.py); it keeps an approximate
copy per instance, built from the prompts it routed there. A prompt is cut into blocks of BLOCK
tokens and each block is named by a hash of the whole prefix up to its end (a hash chain), so "the
instance holds the first k blocks" is k dictionary hits. The chain starts from the request's cache
namespace (router/tenants.py), as the instances' radix trees do: a prompt never matches, and so is
never routed toward, a prefix another namespace sent. An instance's model is an LRU of those
prefix hashes, bounded by the instance's KV capacity in blocks, and it forgets its oldest entries
when the instance reports evictions (`evicted_tokens` in its load answer grew) or when they are
older than `max_age_s`.

Choice (`CacheAwarePolicy.choose`): the candidate with the longest expected match, unless it is
overloaded -- its load (router in-flight + the instance's queue) exceeds the least loaded
candidate's by more than `balance_threshold` -- or nothing matches: then `least_load`'s choice.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

BLOCK = 16  # tokens per block of the router's model (instances' pages are 16 or 64 by default)
MAX_AGE_S = 600.0


def prefix_hashes(token_ids: list[int], block: int = BLOCK, namespace: str = "") -> list[int]:
    """One hash per whole block: hash i names token_ids[: (i + 1) * block] in `namespace`."""
    out, h = [], hash(("namespace", namespace)) if namespace else 0
    for i in range(0, len(token_ids) // block * block, block):
        h = hash((h, tuple(token_ids[i : i + block])))
        out.append(h)
    return out


class PrefixModel:
    """One instance's approximate prefix cache: prefix hash -> last use, least recent first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_age_s: float = MAX_AGE_S):
        self.clock, self.max_age_s = clock, max_age_s
        self.entries: OrderedDict[int, float] = OrderedDict()
        self.capacity_blocks: int | None = None  # from the instance's total_tokens
        self.seen_evicted: int | None = None  # the instance's evicted_tokens at the last poll
        self.enabled = True  # False: the instance runs with --prefix-cache off (it never matches)

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of the prompt this instance is expected to hold."""
        n = 0
        for h in hashes:
            if h not in self.entries:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        if not self.enabled:
            return
        now = self.clock()
        for h in hashes:
            self.entries[h] = now
            self.entries.move_to_end(h)
        self._trim()

    def observe(
        self, total_tokens: int | None, evicted_tokens: int | None, enabled: bool | None = None
    ) -> None:
        """A load answer: capacity bound, the instance's evictions since the last one, and whether it
        caches at all (None: an instance that does not say)."""
        if enabled is not None:
            self.enabled = enabled
            if not enabled:
                self.entries.clear()
        if total_tokens:
            self.capacity_blocks = max(1, total_tokens // BLOCK)
        if evicted_tokens is not None:
            if self.seen_evicted is not None and evicted_tokens >= self.seen_evicted:
                self._drop(-(-(evicted_tokens - self.seen_evicted) // BLOCK))
            elif self.seen_evicted is not None:  # the counter went back: a restarted instance
                self.entries.clear()
            self.seen_evicted = evicted_tokens
        self._trim()

    def clear(self) -> None:
        self.entries.clear()

    def _drop(self, n: int) -> None:
        for _ in range(min(n, len(self.entries))):
            self.entries.popitem(last=False)

    def _trim(self) -> None:
        if self.capacity_blocks is not None and len(self.entries) > self.capacity_blocks:
            self._drop(len(self.entries) - self.capacity_blocks)
        cutoff = self.clock() - self.max_age_s
        while self.entries and next(iter(self.entries.values())) < cutoff:
            self.entries.popitem(last=False)


class CacheAwarePolicy:
    def __init__(self, balance_threshold: int = 4, clock: Callable[[], float] = time.monotonic):
        self.balance_threshold, self.clock = balance_threshold, clock
        self.models: dict[str, PrefixModel] = {}  # instance URL -> its model
        self.match_tokens = 0  # expected prefix tokens of the routed requests (for metrics)
        self.balanced = 0  # choices where the best match was overloaded and least_load chose

    def model(self, url: str) -> PrefixModel:
        if url not in self.models:
            self.models[url] = PrefixModel(self.clock)
        return self.models[url]

    def choose(self, candidates: list, hashes: list[int], load: Callable, busy: Callable):
        """candidates: Instances; load(inst) -> least_load's sort key; busy(inst) -> a number (its
        in-flight + queued requests). Records the prompt in the chosen instance's model."""
        fallback = min(candidates, key=load)
        best = max(candidates, key=lambda i: (self.model(i.url).match(hashes), -candidates.index(i)))
        matched = self.model(best.url).match(hashes)
        chosen = best
        if matched == 0:
            chosen = fallback
        elif busy(best) > busy(fallback) + self.balance_threshold:
            chosen, self.balanced = fallback, self.balanced + 1
        self.match_tokens += self.model(chosen.url).match(hashes) * BLOCK
        self.model(chosen.url).add(hashes)
        return chosen

    def forget(self, url: str) -> None:
        self.models.pop(url, None)
