"""Prefix cache: a radix tree over token ids whose edges are whole KV pages (plain Python, no torch).

A request whose prompt starts with tokens an earlier request already computed reuses that earlier
request's pages instead of recomputing them. The tree maps token prefixes to the pages that hold
their cache entries:

  - page-granular: an edge is a run of whole pages (its key is page_size token ids per page), so a
    match, a split and an eviction always fall on a page boundary and a cached page is never shared
    with a request's own partial last page (a request writes only into pages it owns alone);
  - reference-counted: `lock(node)` pins a node and all its ancestors while a request reads those
    pages (a prefill, a hand-off); only nodes with no reference can be evicted;
  - LRU eviction of unreferenced leaves: under memory pressure `evict(n)` frees the least recently
    used leaves (a parent whose last child went becomes a leaf and a candidate in turn).

Namespaces (tenant isolation, docs/security.md): every key lives under the root of its namespace
(`namespace=`, the request's SamplingParams.cache_namespace, which the router derives from the
client's API key and cache_salt: router/tenants.py; "" is the shared one). A lookup walks only its own namespace's root, so a prompt never matches pages another
namespace cached, whatever their tokens. A namespace's root goes once its last page is evicted.

The tree owns the pages it holds: they are allocated in the PageAllocator (not free) and go back
to it only by eviction or `flush()`. Counters: `cached_pages` (in the tree), `evictable_pages` (in
the tree, no reference), `protected_pages` (in the tree, referenced). The allocator asks the tree
for pages when it runs short (`PageAllocator.evictor`), so a cached page never blocks a request.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Page = tuple[int, ...]  # the token ids of one full page


@dataclass(eq=False)
class Node:
    keys: list[Page] = field(default_factory=list)  # one token tuple per page of this edge
    pages: list[int] = field(default_factory=list)  # the KV page holding each of them
    parent: "Node | None" = None
    children: dict[Page, "Node"] = field(default_factory=dict)  # by the first page's tokens
    refs: int = 0
    last_use: float = 0.0


@dataclass(frozen=True)
class Match:
    pages: list[int]  # the cached pages of the matched prefix, in order
    node: Node  # its deepest node (lock / unlock it)

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], clock=time.monotonic):
        """free_pages: gives pages back to the allocator (evictions, duplicates, flush)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size, self._free_pages, self.clock = page_size, free_pages, clock
        self.root = Node(refs=1)  # namespace "": never evicted, holds no page
        self.roots: dict[str, Node] = {"": self.root}  # namespace -> its root (parent None, no page)
        self.evictable_pages = 0
        self.protected_pages = 0
        self.hit_tokens = 0  # tokens served from the tree by match() (for metrics)
        self.evicted_pages = 0  # pages evicted so far (the router ages its model of this tree by it)
        self._tick = itertools.count()

    @property
    def cached_pages(self) -> int:
        return self.evictable_pages + self.protected_pages

    def _split_pages(self, token_ids: list[int]) -> list[Page]:
        ps = self.page_size
        return [tuple(token_ids[i : i + ps]) for i in range(0, len(token_ids) // ps * ps, ps)]

    # ---- lookups ----------------------------------------------------------------------------
    def _root(self, namespace: str, create: bool) -> Node | None:
        root = self.roots.get(namespace)
        if root is None and create:
            root = self.roots[namespace] = Node(refs=1)
        return root

    def match(self, token_ids: list[int], count: bool = True, namespace: str = "") -> Match:
        """The longest cached prefix of token_ids in whole pages within `namespace` (splits an edge
        matched in part)."""
        node = self._root(namespace, create=False)
        if node is None:  # nothing cached in this namespace: the shared empty root (no page)
            node, token_ids = self.root, []
        keys, pages, now = self._split_pages(token_ids), [], self.clock()
        node.last_use = now
        i = 0
        while i < len(keys) and (child := node.children.get(keys[i])) is not None:
            n = _common(child.keys, keys[i:])
            if n < len(child.keys):
                child = self._split(child, n)
            child.last_use = now
            pages.extend(child.pages)
            node, i = child, i + n
        if count:
            self.hit_tokens += len(pages) * self.page_size
        return Match(pages, node)

    def _split(self, node: Node, n: int) -> Node:
        """Cuts node's edge after n pages; returns the new upper part (same refs, same use time)."""
        upper = Node(node.keys[:n], node.pages[:n], node.parent, {}, node.refs, node.last_use)
        node.parent.children[node.keys[0]] = upper
        node.keys, node.pages, node.parent = node.keys[n:], node.pages[n:], upper
        upper.children[node.keys[0]] = node
        return upper

    # ---- references -------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """Pins node and its ancestors (their pages are read by a running request)."""
        while node.parent is not None:
            if node.refs == 0:
                self.evictable_pages -= len(node.pages)
                self.protected_pages += len(node.pages)
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            if node.refs <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.refs -= 1
            if node.refs == 0:
                self.evictable_pages += len(node.pages)
                self.protected_pages -= len(node.pages)
            node = node.parent

    # ---- insertion --------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int], namespace: str = "") -> list[int]:
        """Caches the whole pages of a computed prompt (pages[i] holds tokens [i*ps, (i+1)*ps)) in
        `namespace`. Returns the caller's pages the tree did not take: those of a prefix it already
        held under other pages (duplicates) and a trailing partial page; the caller frees them."""
        keys = self._split_pages(token_ids)
        if len(pages) < len(keys):
            raise ValueError(f"{len(keys)} full pages of tokens but only {len(pages)} pages")
        rest, now, i = list(pages[len(keys) :]), self.clock(), 0
        node = self._root(namespace, create=bool(keys))
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                new = Node(keys[i:], list(pages[i : len(keys)]), node, {}, 0, now)
                node.children[keys[i]] = new
                self.evictable_pages += len(new.pages)
                break
            n = _common(child.keys, keys[i:])
            if n < len(child.keys):
                child = self._split(child, n)
            child.last_use = now
            rest.extend(p for p, own in zip(pages[i : i + n], child.pages) if p != own)
            node, i = child, i + n
        return rest

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Frees at least num_pages pages (fewer if not enough are unreferenced), least recently used
        leaves first; returns how many were freed."""
        heap = [(n.last_use, next(self._tick), n) for n in self._leaves() if n.refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            freed.extend(node.pages)
            parent = node.parent
            del parent.children[node.keys[0]]
            self.evictable_pages -= len(node.pages)
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_use, next(self._tick), parent))
            elif parent.parent is None and not parent.children and parent is not self.root:
                self.roots = {ns: r for ns, r in self.roots.items() if r is not parent}  # empty namespace
        if freed:
            self.evicted_pages += len(freed)
            self._free_pages(freed)
        return len(freed)

    def flush(self) -> int:
        """Evicts every unreferenced page (the admin flush); referenced ones stay until unlocked."""
        return self.evict(self.evictable_pages)

    def _leaves(self) -> list[Node]:
        out, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None:
                out.append(node)
        return out

    def all_pages(self) -> list[int]:
        """Every page the tree holds (for integrity checks)."""
        out, stack = [], list(self.roots.values())
        while stack:
            node = stack.pop()
            out.extend(node.pages)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        pages = self.all_pages()
        assert len(pages) == len(set(pages)), "a page is in the tree twice"
        assert len(pages) == self.cached_pages, f"{len(pages)} pages in the tree, counted {self.cached_pages}"
        stack = [c for root in self.roots.values() for c in root.children.values()]
        assert all(r.parent is None and not r.pages for r in self.roots.values()), "a root holds pages"
        while stack:
            node = stack.pop()
            assert node.keys and len(node.keys) == len(node.pages), "an empty or uneven edge"
            assert node.refs >= sum(c.refs for c in node.children.values()), (
                "a child outlives its parent's refs"
            )
            stack.extend(node.children.values())


def _common(a: list[Page], b: list[Page]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
