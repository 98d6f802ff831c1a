"""Packing plan of one request's cache hand-off from a prefill instance to a decode instance.

The plan lists, for one request, the rows each prefill rank sends to each decode rank: one
`Transfer` per (src_rank, dst_rank, layer, kind) with at least one row, made of `Run`s (first
source row, first destination row, length, source step). It is a pure function of the two layouts (no torch,
no I/O): every prefill rank computes the same plan and executes the transfers it is the source of.

Where position p of the prompt lives (docs/design.md section 3, invariant 4):
  prefill  every rank that holds layer l keeps p's entries at prefill slot `slots[p]` (the same
           slot numbering on every rank). `full`: every rank holds every layer. `layer-split`:
           rank r holds a contiguous block of layers (`layer_owners`, the rule of
           prefill_server.cp_backend, re-implemented here to stay torch-free; a test checks they agree).
  decode   global slot s = pages[p // page_size] * page_size + p % page_size. The W ranks form
           W / C_d DCP groups of C_d consecutive ranks; in EVERY group the member with group rank
           s % C_d stores p's latent entry ("kv") at row s // C_d, so each group holds one full copy.
           Index keys ("index", indexer layers only): mode "copy" -> every decode rank, at row s;
           mode "split" -> only the latent owners, at row s // C_d.

Who sends:
  layer-split  the layer's owner, the only prefill rank that has it.
  full         every prefill rank has everything, so the sending is spread. The unit is a whole
               (layer, dst_rank) pair (its kv and index rows travel together). Pairs are taken in
               decreasing row count (ties: ascending (layer, dst_rank)) and each goes to the prefill
               rank that has the fewest rows so far (ties: lowest rank) -- greedy longest-first.
               Each rank gets a disjoint share; all ranks send once there are >= C_p pairs; the
               busiest rank sends at most the average plus one pair's rows.

Streamed (`plan_stream`): the prefill sends each chunk's rows while it computes the next layers
(prefill_server/handoff_stream.py), so the rows are cut into segments of positions at the chunks'
starts (plus one for the positions the prefill's prefix cache held), each planned like a whole
prompt; the senders are the whole prompt's, so a decode rank receives from each prefill rank what
it would unstreamed, and a stream (src_rank, layer, kind) is its segments' rows one after the other.

Why runs: the sender packs and the receiver stores rows run by run, and the notification names the
destination runs, so a plan must stay small. A run's destination rows advance by 1; its source rows
by a fixed `step`: a DCP destination stores every C_d-th position, so from a contiguous prefill
cache its rows have source stride C_d (with step 1 a 16k-token prompt gave ~100k one-row runs per
destination, and per-run Python work cost more than moving the bytes). A transfer's rows are sorted
by source row, then merged greedily: a row joins the last run when its destination is the next one
and its source is one step further (a one-row run takes the step of its second row).
"""

from __future__ import annotations

from dataclasses import dataclass

CACHE_MODES = ("full", "layer-split")
INDEX_MODES = ("copy", "split")


def layer_owners(num_layers: int, cp_size: int) -> list[int]:
    """Prefill rank that stores each layer in layer-split mode: contiguous blocks, as even as possible.
    Same rule as `pdserve.prefill_server.cp_backend.layer_owners`."""
    return [
        min(r for r in range(cp_size) if layer < (r + 1) * num_layers // cp_size)
        for layer in range(num_layers)
    ]


@dataclass(frozen=True)
class PrefillSide:
    cp_size: int
    cache: str  # "full" | "layer-split"
    num_layers: int
    indexer_layers: tuple[int, ...]
    slots: tuple[int, ...]  # prefill slot of each prompt position 0..n-1 (same on every prefill rank)

    def __post_init__(self):
        object.__setattr__(self, "indexer_layers", tuple(self.indexer_layers))
        object.__setattr__(self, "slots", tuple(self.slots))
        if self.cp_size < 1 or self.num_layers < 1:
            raise ValueError(f"need cp_size >= 1 and num_layers >= 1, got {self.cp_size}, {self.num_layers}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"unknown prefill cache mode {self.cache!r} (allowed: {CACHE_MODES})")
        bad = [i for i in self.indexer_layers if not 0 <= i < self.num_layers]
        if bad or len(set(self.indexer_layers)) != len(self.indexer_layers):
            raise ValueError(
                f"indexer_layers {self.indexer_layers} must be distinct layers in [0, {self.num_layers})"
            )

    def holds(self, rank: int, layer: int) -> bool:
        return self.cache == "full" or layer_owners(self.num_layers, self.cp_size)[layer] == rank


@dataclass(frozen=True)
class DecodeSide:
    tp_size: int  # W
    dcp_size: int  # C_d, divides W
    index_mode: str  # "copy" | "split"
    page_size: int  # multiple of dcp_size
    pages: tuple[int, ...]  # global pages reserved for the request (enough for the prompt)

    def __post_init__(self):
        object.__setattr__(self, "pages", tuple(self.pages))
        if self.tp_size < 1 or self.dcp_size < 1 or self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size {self.dcp_size} must divide tp_size {self.tp_size} (both >= 1)")
        if self.index_mode not in INDEX_MODES:
            raise ValueError(f"unknown index mode {self.index_mode!r} (allowed: {INDEX_MODES})")
        if self.page_size < 1 or self.page_size % self.dcp_size:
            raise ValueError(
                f"page_size {self.page_size} must be a positive multiple of dcp_size {self.dcp_size}"
            )


@dataclass(frozen=True)
class Run:
    src: int  # first source row (prefill slot)
    dst: int  # first destination row on the decode rank
    length: int
    step: int = 1  # source row i of the run is src + i * step; destination row i is dst + i

    def src_rows(self) -> range:
        return range(self.src, self.src + self.length * self.step, self.step)


@dataclass(frozen=True)
class Transfer:
    src_rank: int
    dst_rank: int
    layer: int
    kind: str  # "kv" (latent entries) | "index" (index keys)
    runs: tuple[Run, ...]  # maximal runs, ascending source rows

    @property
    def rows(self) -> int:
        return sum(r.length for r in self.runs)


def plan_transfer(
    prefill: PrefillSide, decode: DecodeSide, prompt_len: int, start: int = 0
) -> list[Transfer]:
    """Every row of positions [start, prompt_len) of the prompt's cache that the decode instance
    stores, with its source; sorted by (src_rank, dst_rank, layer, kind). start > 0: the decode
    instance already holds the first `start` positions (its prefix cache, whole pages) in the
    leading reserved pages, on the ranks their slots name, so they are not sent."""
    _check_room(prefill, decode, prompt_len)
    if not 0 <= start <= prompt_len or start % decode.page_size:
        raise ValueError(
            f"start {start} must be a multiple of the page size {decode.page_size} in [0, {prompt_len}]"
        )
    if prompt_len == start:
        return []
    pairs = _pairs(prefill, decode, start, prompt_len)
    return _assign(pairs, _senders(prefill, _pair_rows(pairs)))


@dataclass(frozen=True)
class Segment:
    """The rows of prompt positions [first, end) in a streamed hand-off: plan[lo:hi]."""

    first: int
    end: int
    lo: int
    hi: int


def plan_stream(
    prefill: PrefillSide, decode: DecodeSide, prompt_len: int, start: int, bounds: list[int]
) -> tuple[list[Transfer], list[Segment]]:
    """A streamed hand-off (rows leave as soon as they exist): the rows of positions [start,
    prompt_len) cut at `bounds` (ascending positions: where the prefill's chunks begin, so each
    segment's rows exist once its chunk is computed) into segments, each planned as plan_transfer
    plans a whole prompt, and (the plan of every segment in order, the segments). Each (layer,
    dst_rank) pair has the same sender in every segment (the whole prompt's assignment), so every
    rank ships a decode rank the rows it would ship unstreamed and the decode side's expectations
    do not change; a stream (src_rank, layer, kind) carries its rows segment after segment."""
    _check_room(prefill, decode, prompt_len)
    if not 0 <= start <= prompt_len or start % decode.page_size:
        raise ValueError(
            f"start {start} must be a multiple of the page size {decode.page_size} in [0, {prompt_len}]"
        )
    if list(bounds) != sorted(set(bounds)):
        raise ValueError(f"segment bounds must ascend without repeats, got {bounds}")
    if prompt_len == start:
        return [], []
    senders = _senders(prefill, _pair_rows(_pairs(prefill, decode, start, prompt_len)))
    cuts = [start] + [b for b in bounds if start < b < prompt_len] + [prompt_len]
    plan: list[Transfer] = []
    segments = []
    for first, end in zip(cuts, cuts[1:]):
        lo = len(plan)
        plan += _assign(_pairs(prefill, decode, first, end), senders)
        segments.append(Segment(first, end, lo, len(plan)))
    return plan, segments


Pairs = dict[tuple[int, int], dict[str, tuple[Run, ...]]]  # (layer, dst_rank) -> kind -> runs


def _pairs(prefill: PrefillSide, decode: DecodeSide, first: int, end: int) -> Pairs:
    """The runs each (layer, dst_rank) pair stores of positions [first, end), per kind."""
    member_runs, all_runs = _runs(prefill, decode, end, first)
    C, indexer = decode.dcp_size, set(prefill.indexer_layers)
    pairs: Pairs = {}
    for layer in range(prefill.num_layers):
        for dst in range(decode.tp_size):
            kinds = {"kv": member_runs[dst % C]}  # group rank = dst % C_d (groups are C_d-aligned)
            if layer in indexer:
                kinds["index"] = all_runs if decode.index_mode == "copy" else member_runs[dst % C]
            if kinds := {k: runs for k, runs in kinds.items() if runs}:
                pairs[layer, dst] = kinds
    return pairs


def _pair_rows(pairs: Pairs) -> dict[tuple[int, int], int]:
    return {pair: sum(r.length for rs in kinds.values() for r in rs) for pair, kinds in pairs.items()}


def _assign(pairs: Pairs, senders: dict[tuple[int, int], int]) -> list[Transfer]:
    plan = [
        Transfer(senders[layer, dst], dst, layer, kind, runs)
        for (layer, dst), kinds in pairs.items()
        for kind, runs in kinds.items()
    ]
    return sorted(plan, key=lambda t: (t.src_rank, t.dst_rank, t.layer, t.kind))


def bytes_per_pair(
    plan: list[Transfer], kv_row_bytes: int, index_row_bytes: int
) -> dict[tuple[int, int], int]:
    """Bytes each prefill rank ships to each decode rank: {(src_rank, dst_rank): bytes}."""
    row_bytes = {"kv": kv_row_bytes, "index": index_row_bytes}
    out: dict[tuple[int, int], int] = {}
    for t in plan:
        key = (t.src_rank, t.dst_rank)
        out[key] = out.get(key, 0) + t.rows * row_bytes[t.kind]
    return out


def summary(plan: list[Transfer]) -> dict[str, int]:
    """Sizes for staging buffers and descriptor lists: transfers, runs, kv_rows, index_rows."""
    out = {"transfers": len(plan), "runs": sum(len(t.runs) for t in plan), "kv_rows": 0, "index_rows": 0}
    for t in plan:
        out[f"{t.kind}_rows"] += t.rows
    return out


def _check_room(prefill: PrefillSide, decode: DecodeSide, n: int) -> None:
    if n < 0:
        raise ValueError(f"prompt_len must be >= 0, got {n}")
    if len(prefill.slots) < n:
        raise ValueError(f"prefill side gives {len(prefill.slots)} slots for a {n}-token prompt")
    need = -(-n // decode.page_size)
    if len(decode.pages) < need:
        raise ValueError(
            f"decode side gives {len(decode.pages)} pages of {decode.page_size} slots "
            f"for a {n}-token prompt (needs {need})"
        )
    slots, pages = prefill.slots[:n], decode.pages[:need]
    if min(slots, default=0) < 0 or len(set(slots)) != n:
        raise ValueError("prefill slots of the prompt must be distinct and >= 0")
    if min(pages, default=0) < 0 or len(set(pages)) != need:
        raise ValueError("decode pages of the prompt must be distinct and >= 0")


def _runs(prefill: PrefillSide, decode: DecodeSide, n: int, start: int = 0):
    """Merged runs of the rows each DCP group member stores (row s // C_d), and of all positions
    at row s (copied index), for positions [start, n). Shared by every layer and every group."""
    C, ps = decode.dcp_size, decode.page_size
    member: list[list[tuple[int, int]]] = [[] for _ in range(C)]
    every: list[tuple[int, int]] = []
    for p in range(start, n):
        s = decode.pages[p // ps] * ps + p % ps
        member[s % C].append((prefill.slots[p], s // C))
        every.append((prefill.slots[p], s))
    return [_merge(rows) for rows in member], _merge(every)


def _merge(rows: list[tuple[int, int]]) -> tuple[Run, ...]:
    runs: list[list[int]] = []  # [src, dst, length, step]
    for src, dst in sorted(rows):
        last = runs[-1] if runs else None
        if last and last[1] + last[2] == dst and (last[2] == 1 or last[0] + last[2] * last[3] == src):
            if last[2] == 1:
                last[3] = src - last[0]  # sources are sorted and distinct: step >= 1
            last[2] += 1
        else:
            runs.append([src, dst, 1, 1])
    return tuple(Run(*r) for r in runs)


def _senders(prefill: PrefillSide, rows: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """Prefill rank that sends each (layer, dst_rank) pair (see "Who sends" above)."""
    if prefill.cache == "layer-split":
        owners = layer_owners(prefill.num_layers, prefill.cp_size)
        return {pair: owners[pair[0]] for pair in rows}
    sent = [0] * prefill.cp_size
    out = {}
    for pair in sorted(rows, key=lambda pair: (-rows[pair], pair)):
        out[pair] = rank = min(range(prefill.cp_size), key=lambda r: (sent[r], r))
        sent[rank] += rows[pair]
    return out
