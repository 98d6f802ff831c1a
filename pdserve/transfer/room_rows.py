"""What a decode rank's receiver knows of one room, and the checks every arriving frame passes
before a byte of it is stored (docs/design.md invariants 8 and 11) -- shared by the TCP data path
(transfer/tcp.py) and NIXL notifications (transfer/nixl.py).

  - `check_header` / `check_notif`: the decoded header of a data frame / notification has exactly
    the fields of the protocol, of the right types and sizes; anything else is a ValueError;
  - `RoomSlots`: the pool rows that are the room's own -- the rows of its reserved pages on this
    rank, from the room's reservation (ExpectCmd) -- and `frame_rows` refuses any run outside them,
    before anything of the frame is written: rows for another request's slots fail the sender's
    room, and the rest of the pool stays untouched;
  - `RoomRows`: rows expected per source, rows stored, their checksum, the room's first error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .base import RoomChecksum
from .frames import TICKET_BYTES

DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
KINDS = ("kv", "index")
MAX_RUNS, MAX_ROW = 1 << 20, 1 << 40


@dataclass(frozen=True)
class RoomStatus:
    """One decode rank's view of one room (in its ReceiverStatus)."""

    known: bool  # False: the rank does not expect the room (dropped, or never expected)
    rows: int = 0
    expected: int = 0
    complete: bool = False  # every expected row came (NIXL: and the room's ExpectCmd)
    checksum: int = 0
    error: str | None = None
    first_row_at: float | None = None  # time.monotonic() when its first rows were counted (checksummed)
    last_row_at: float | None = None  # ... and when its latest were (the last: with the room MAC taken)


@dataclass(frozen=True)
class RoomSlots:
    """The rows of a decode rank's pool that belong to one room: those of its pages. A page of
    page_size slots is page_size // C_d latent rows on every DCP rank (rows page * that, onwards),
    and page_size index rows with a copied index (page_size // C_d when split)."""

    pages: frozenset[int]
    rows_per_page: dict[str, int]  # kind -> rows one page holds on this rank

    @classmethod
    def of(cls, pages, page_size: int, dcp_size: int, index_mode: str) -> "RoomSlots":
        own = page_size // dcp_size
        return cls(frozenset(pages), {"kv": own, "index": page_size if index_mode == "copy" else own})

    def check(self, kind: str, dst: int, n: int) -> None:
        """ValueError unless rows [dst, dst + n) of `kind` all lie in the room's pages."""
        if n == 0:
            return
        per = self.rows_per_page.get(kind, 0)
        first, last = dst // per if per else -1, (dst + n - 1) // per if per else -1
        if (
            per < 1
            or last - first >= len(self.pages)
            or any(p not in self.pages for p in range(first, last + 1))
        ):
            raise ValueError(f"{kind} rows [{dst}, +{n}) are not the room's (another request's slots)")


def _is_int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v < hi


def _runs(v) -> list:
    if (
        type(v) is not list
        or len(v) > MAX_RUNS
        or not all(
            type(r) is list and len(r) == 2 and _is_int(r[0], 0, MAX_ROW) and _is_int(r[1], 0, MAX_ROW)
            for r in v
        )
    ):
        raise ValueError("runs: expected a list of [row, length] pairs")
    return v


def _common(h) -> None:
    if type(h) is not dict:
        raise ValueError("the header is not a map")
    if not (type(h.get("room")) is str and len(h["room"]) <= 1024):
        raise ValueError("room: expected a string")
    if not (type(h.get("ticket")) is bytes and len(h["ticket"]) == TICKET_BYTES):
        raise ValueError(f"ticket: expected {TICKET_BYTES} bytes")
    if not _is_int(h.get("src_rank"), 0, 4096) or h.get("dtype") not in DTYPES:
        raise ValueError("src_rank or dtype out of range")


def check_header(h) -> dict:
    """A TCP data frame's header {room, ticket, src_rank, layer, kind, runs, dtype, width, seq}, checked."""
    _common(h)
    if set(h) != {"room", "ticket", "src_rank", "layer", "kind", "runs", "dtype", "width", "seq"}:
        raise ValueError("the header's fields are not the protocol's")
    if not (
        _is_int(h["layer"], 0, 1 << 16)
        and h["kind"] in KINDS
        and _is_int(h["width"], 1, 1 << 24)
        and _is_int(h["seq"], 0, 1 << 62)
    ):
        raise ValueError("layer, kind, width or seq out of range")
    _runs(h["runs"])
    return h


def check_notif(h) -> dict:
    """A NIXL notification's header {room, ticket, src_rank, offset, nbytes, dtype, items}, checked;
    items: [[layer, kind, width, runs], ...]."""
    _common(h)
    if set(h) != {"room", "ticket", "src_rank", "offset", "nbytes", "dtype", "items"}:
        raise ValueError("the notification's fields are not the protocol's")
    if not (
        _is_int(h["offset"], 0, MAX_ROW)
        and _is_int(h["nbytes"], 0, MAX_ROW)
        and type(h["items"]) is list
        and len(h["items"]) <= MAX_RUNS
    ):
        raise ValueError("offset, nbytes or items out of range")
    for item in h["items"]:
        if not (
            type(item) is list
            and len(item) == 4
            and _is_int(item[0], 0, 1 << 16)
            and item[1] in KINDS
            and _is_int(item[2], 1, 1 << 24)
        ):
            raise ValueError("an item is not [layer, kind, width, runs]")
        _runs(item[3])
    return h


SLICE_RUNS = 64  # frames with at most this many destination runs are stored run by run
ANY_SRC = -1


@dataclass
class RoomRows:
    """What a receiver knows of one room: rows expected per source, rows stored, their checksum."""

    ticket: bytes
    expected: dict[int, int]  # src_rank (or ANY_SRC) -> rows
    slots: RoomSlots | None = None  # the pool rows that are the room's (None: none yet, every row refused)
    received: dict[int, int] = field(default_factory=dict)
    checksum: RoomChecksum = field(default_factory=RoomChecksum)
    error: str | None = None
    first_at: float | None = None  # time.monotonic() when its first rows were counted (and checksummed)
    last_at: float | None = None  # ... and when its latest were (the last: with the room MAC taken)

    @property
    def complete(self) -> bool:
        """Every expected row came."""
        return sum(self.received.values()) == sum(self.expected.values())

    def status(self) -> RoomStatus:
        complete = self.complete
        return RoomStatus(
            True,
            sum(self.received.values()),
            sum(self.expected.values()),
            complete,
            self.checksum.value() if complete else 0,  # the MAC of every row: once they came
            self.error,
            self.first_at,
            self.last_at,
        )


def _count_key(r: RoomRows, src: int) -> int:
    return src if src in r.expected else ANY_SRC


def frame_rows(pool, r: RoomRows, h: dict, nbytes: int) -> int:
    """The number of destination rows of one frame (header h: src_rank, layer, kind, runs, dtype,
    width) of nbytes payload bytes, after checking it fits this rank's pool and the room's
    expectations; ValueError (or KeyError / TypeError on a malformed header) says why it does not."""
    layer, src = h["layer"], h["src_rank"]
    if h["kind"] == "kv":
        width, limit, ok = pool.kv.shape[-1], pool.num_slots, pool.holds(layer)
    elif h["kind"] == "index":
        width, limit, ok = pool.index_k.shape[-1], pool.index_slots, layer in pool.index_row
    else:
        raise ValueError(f"unknown kind {h['kind']!r}")
    if not ok:
        raise ValueError(f"this rank stores no {h['kind']} for layer {layer}")
    if h["width"] != width or h["dtype"] not in DTYPES:
        raise ValueError(
            f"layout mismatch: got width {h['width']} dtype {h['dtype']}, rank stores width {width}"
        )
    if r.slots is None:
        raise ValueError("the room has no reserved slots on this rank")
    rows = 0
    for dst, n in h["runs"]:
        if not (isinstance(dst, int) and isinstance(n, int) and n >= 0 and 0 <= dst and dst + n <= limit):
            raise ValueError(f"run [{dst}, +{n}) out of range [0, {limit})")
        r.slots.check(h["kind"], dst, n)  # only the room's own pages: never another request's rows
        rows += n
    key = _count_key(r, src)
    if r.received.get(key, 0) + rows > r.expected.get(key, 0):
        raise ValueError(f"more rows than expected from prefill rank {src}")
    if nbytes != rows * width * DTYPES[h["dtype"]].itemsize:
        raise ValueError(f"payload of {nbytes} bytes for {rows} rows of width {width}")
    return rows


def run_rows(starts: list[int], lengths: list[int], steps: list[int] | None = None) -> torch.Tensor:
    """Rows start, start + step, ..., start + (length - 1) * step of every run, in run order, without
    a Python loop per run (a plan may hold thousands of short runs). Host indices: the pool moves
    them to its device (kvcache/kv_cache.py)."""
    cpu = torch.device("cpu")
    if not starts:
        return torch.empty(0, dtype=torch.int64, device=cpu)
    s = torch.tensor(starts, dtype=torch.int64, device=cpu)
    n = torch.tensor(lengths, dtype=torch.int64, device=cpu)
    if int(n.min()) < 0:
        raise ValueError("a run has a negative length")
    first = torch.cumsum(n, 0) - n  # where each run begins among the packed rows
    within = torch.arange(int(n.sum()), device=cpu) - torch.repeat_interleave(
        first, n
    )  # i: the row's index in its run
    step = (
        torch.repeat_interleave(torch.tensor(steps, dtype=torch.int64, device=cpu), n)
        if steps is not None
        else 1
    )
    return torch.repeat_interleave(s, n) + within * step


def payload_rows(payload, h: dict, rows: int) -> torch.Tensor:
    """A checked frame's payload (writable bytes-like) as its [rows, width] tensor, without a copy."""
    return torch.frombuffer(payload, dtype=torch.uint8).view(DTYPES[h["dtype"]]).view(rows, h["width"])


def store_rows(pool, r: RoomRows, h: dict, data: torch.Tensor) -> None:
    """Writes a checked frame's rows `data` [rows, width] into the pool, counts them, and only THEN
    checksums `data`: bytes that change under the store make the checksum disagree with the sender's."""
    write = pool.write_kv if h["kind"] == "kv" else pool.write_index
    if (
        len(h["runs"]) <= SLICE_RUNS
    ):  # a few long runs (the usual case): slice copies, ~2x index_copy_'s speed
        pos = 0
        for dst, n in h["runs"]:
            write(h["layer"], slice(dst, dst + n), data[pos : pos + n])
            pos += n
    else:
        write(h["layer"], run_rows([d for d, _ in h["runs"]], [n for _, n in h["runs"]]), data)
    count_rows(r, h, [data])


def count_rows(r: RoomRows, h: dict, parts: list[torch.Tensor]) -> None:
    """Counts a checked frame's stored rows and hashes them for the room MAC (parts: [rows, width], in run order;
    h["order"], where given, is the frame's place in its sender's sequence: RoomChecksum)."""
    key = _count_key(r, h["src_rank"])
    if r.first_at is None:
        r.first_at = time.monotonic()
    r.received[key] = r.received.get(key, 0) + sum(len(rows) for rows in parts)
    for rows in parts:  # each where it lies: row hashes do not depend on how the rows are split
        r.checksum.update(h["src_rank"], h["layer"], h["kind"], rows, h.get("order", ()))
    if r.complete:
        r.checksum.value()  # the last rows: the room MAC now (cached for status), so last_at is when it was checked
    r.last_at = time.monotonic()
