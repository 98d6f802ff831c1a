"""TCP data path of a KV hand-off: prefill ranks PUSH packed rows, decode ranks PULL and store them.

Wire: one ZMQ multipart message per transfer (src_rank, dst_rank, layer, kind) of the plan:
    [msgpack header, payload]
    header  {room, ticket, src_rank, layer, kind, runs: [[dst_start, length], ...], dtype, width, seq}
    payload the rows in run order, contiguous [rows, width] of `dtype` (raw bytes).
One PUSH socket per destination endpoint (cached), so frames to one decode rank arrive in the
order they were sent; `seq` counts frames per (room, destination) for debugging.

The command dataclasses, the room bookkeeping (`RoomRows`) and the frame checks (`frame_rows`,
`store_rows`) are shared with the NIXL data path (transfer/nixl.py), which honours the same commands.

Receiver invariants (DESIGN.md 3.7-3.8):
  - rows are written into the pool ONLY for a room that is currently expected with the same ticket
    (`ExpectCmd`); anything else (late data of an aborted room, an old reuse of the room id) is
    dropped and counted, never stored where a live request could decode it;
  - a frame that does not fit (dtype, width, rows out of range, more rows than expected) marks the
    room failed and is not written;
  - per room: rows received vs expected and a `RoomChecksum` over the payloads, which the
    hand-off compares with the senders' (`TransferStatusCmd`); `ForgetCmd` drops the room.
The receiver thread and the rank's command loop share the room table: one lock guards it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import torch
import zmq

from .base import RoomChecksum
from .plan import Transfer

DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@dataclass(frozen=True)
class ExpectCmd:
    """Decode ranks: accept rows for `room`; expected[dst_rank][src_rank] = rows (each rank takes its own).
    src_rank ANY_SRC counts rows from every source: the decode side alone knows each rank's total
    (every stored row arrives exactly once), not how the prefill spreads the sending."""

    room: str
    ticket: int
    expected: dict[int, dict[int, int]]


@dataclass(frozen=True)
class StageCmd:
    """Decode ranks, at reservation time: get ready to receive `room`; rows[dst_rank] = {kind: rows}
    this rank will store. Reply {"endpoint": where the senders write, "error": None or why}. TCP's
    endpoint is the rank's socket; NIXL's also names a receive region reserved for this room."""

    room: str
    ticket: int
    rows: dict[int, dict[str, int]]


@dataclass(frozen=True)
class TransferStatusCmd:
    room: str


@dataclass(frozen=True)
class ForgetCmd:
    """Drops the room. quiesced: the caller knows no sender will write for it any more (every
    prefill rank's SendCmd returned), so a NIXL receive region is reusable at once; otherwise it is
    quarantined (transfer/nixl.py)."""

    room: str
    quiesced: bool = False


@dataclass(frozen=True)
class SendCmd:
    """Prefill ranks: send the transfers of `plan` whose src_rank is this rank."""

    room: str
    ticket: int
    plan: list[Transfer]
    endpoints: dict[int, str]  # decode rank -> "tcp://host:port"
    corrupt: bool = False  # test hook: flip one payload byte after checksumming (checksum must catch it)
    send_timeout_ms: int = 10_000  # a destination that accepts nothing for this long is dead for this room


SLICE_RUNS = 64  # frames with at most this many destination runs are stored run by run
TRANSFER_CMDS = (StageCmd, ExpectCmd, TransferStatusCmd, ForgetCmd)
ANY_SRC = -1


@dataclass
class RoomRows:
    """What a receiver knows of one room: rows expected per source, rows stored, their checksum."""

    ticket: int
    expected: dict[int, int]  # src_rank (or ANY_SRC) -> rows
    received: dict[int, int] = field(default_factory=dict)
    checksum: RoomChecksum = field(default_factory=RoomChecksum)
    error: str | None = None

    def status(self) -> dict:
        rows, expected = sum(self.received.values()), sum(self.expected.values())
        return {"known": True, "rows": rows, "expected": expected, "complete": rows == expected,
                "checksum": self.checksum.value(), "error": self.error}


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
        raise ValueError(f"layout mismatch: got width {h['width']} dtype {h['dtype']}, rank stores width {width}")
    rows = 0
    for dst, n in h["runs"]:
        if not (isinstance(dst, int) and isinstance(n, int) and n >= 0 and 0 <= dst and dst + n <= limit):
            raise ValueError(f"run [{dst}, +{n}) out of range [0, {limit})")
        rows += n
    key = _count_key(r, src)
    if r.received.get(key, 0) + rows > r.expected.get(key, 0):
        raise ValueError(f"more rows than expected from prefill rank {src}")
    if nbytes != rows * width * DTYPES[h["dtype"]].itemsize:
        raise ValueError(f"payload of {nbytes} bytes for {rows} rows of width {width}")
    return rows


def run_rows(starts: list[int], lengths: list[int], steps: list[int] | None = None) -> torch.Tensor:
    """Rows start, start + step, ..., start + (length - 1) * step of every run, in run order, without
    a Python loop per run (a plan may hold thousands of short runs)."""
    if not starts:
        return torch.empty(0, dtype=torch.int64)
    s, n = torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    if int(n.min()) < 0:
        raise ValueError("a run has a negative length")
    first = torch.cumsum(n, 0) - n  # where each run begins among the packed rows
    within = torch.arange(int(n.sum())) - torch.repeat_interleave(first, n)  # i: the row's index in its run
    step = torch.repeat_interleave(torch.tensor(steps, dtype=torch.int64), n) if steps is not None else 1
    return torch.repeat_interleave(s, n) + within * step


def pack_rows(pool, kind: str, layer: int, runs, out: torch.Tensor) -> None:
    """Reads the source rows of `runs` (plan Runs, rows in run order) into `out` [rows, width]:
    strided slice copies for a few runs, one gather for many."""
    if len(runs) > SLICE_RUNS:
        pool.read_into(kind, layer, run_rows([r.src for r in runs], [r.length for r in runs], [r.step for r in runs]), out)
        return
    pos = 0
    for r in runs:
        pool.read_into(kind, layer, slice(r.src, r.src + (r.length - 1) * r.step + 1, r.step), out[pos:pos + r.length])
        pos += r.length


def payload_rows(payload, h: dict, rows: int) -> torch.Tensor:
    """A checked frame's payload (writable bytes-like) as its [rows, width] tensor, without a copy."""
    return torch.frombuffer(payload, dtype=torch.uint8).view(DTYPES[h["dtype"]]).view(rows, h["width"])


def store_rows(pool, r: RoomRows, h: dict, data: torch.Tensor) -> None:
    """Writes a checked frame's rows `data` [rows, width] into the pool, counts them, and only THEN
    checksums `data`: bytes that change under the store make the checksum disagree with the sender's."""
    write = pool.write_kv if h["kind"] == "kv" else pool.write_index
    if len(h["runs"]) <= SLICE_RUNS:  # a few long runs (the usual case): slice copies, ~2x index_copy_'s speed
        pos = 0
        for dst, n in h["runs"]:
            write(h["layer"], slice(dst, dst + n), data[pos:pos + n])
            pos += n
    else:
        write(h["layer"], run_rows([d for d, _ in h["runs"]], [n for _, n in h["runs"]]), data)
    count_rows(r, h, [data])


def count_rows(r: RoomRows, h: dict, parts: list[torch.Tensor]) -> None:
    """Counts a checked frame's stored rows and checksums them (parts: [rows, width], in run order)."""
    key = _count_key(r, h["src_rank"])
    for rows in parts:
        r.received[key] = r.received.get(key, 0) + len(rows)
        r.checksum.update(h["src_rank"], h["layer"], h["kind"], rows)


class TcpReceiver:
    """One per decode rank: a PULL socket on 127.0.0.1 (ephemeral port) and the thread that drains it."""

    def __init__(self, rank: int, pool: Callable[[], object], host: str = "127.0.0.1"):
        self.rank, self.pool = rank, pool  # pool(): the rank's current KVPool (reconfigure replaces it)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.lock = threading.Lock()
        self.rooms: dict[str, RoomRows] = {}
        self.dropped = 0  # frames for rooms not expected (late or stale): ignored by design
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"kv-recv-{rank}", daemon=True)
        self.thread.start()

    def handle(self, cmd):
        with self.lock:
            if isinstance(cmd, StageCmd):
                return {"endpoint": self.endpoint, "error": None}  # one socket for every room
            if isinstance(cmd, ExpectCmd):
                self.rooms[cmd.room] = RoomRows(cmd.ticket, dict(cmd.expected.get(self.rank, {})))
                return None
            if isinstance(cmd, ForgetCmd):
                self.rooms.pop(cmd.room, None)
                return None
            if isinstance(cmd, TransferStatusCmd):
                return self._status(cmd.room)
        raise TypeError(f"unknown transfer command {type(cmd).__name__}")

    def _status(self, room: str) -> dict:
        r = self.rooms.get(room)
        base = {"open_rooms": len(self.rooms), "dropped": self.dropped}
        return {**base, **(r.status() if r else {"known": False})}

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            header, payload = self.sock.recv_multipart(copy=True)
            try:
                h = msgpack.unpackb(header, raw=False)
            except Exception:
                with self.lock:
                    self.dropped += 1
                continue
            with self.lock:  # held while writing: status never sees half a frame
                self._on_frame(h, payload)

    def _on_frame(self, h: dict, payload: bytes) -> None:
        r = self.rooms.get(h.get("room"))
        if r is None or r.ticket != h.get("ticket") or r.error is not None:
            self.dropped += 1
            return
        try:
            rows = frame_rows(self.pool(), r, h, len(payload))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            r.error = f"bad frame from prefill rank {h.get('src_rank')}: {e}"
            return
        store_rows(self.pool(), r, h, payload_rows(bytearray(payload), h, rows))

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2.0)
        self.sock.close()
        self.ctx.term()


class TcpSender:
    """One per prefill rank: packs its share of a plan per (layer, kind) and PUSHes it."""

    def __init__(self, rank: int, pool: object):
        self.rank, self.pool = rank, pool
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}

    def _sock(self, endpoint: str, timeout_ms: int) -> zmq.Socket:
        if endpoint not in self.socks:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)  # a dead receiver must not block shutdown
            s.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: a dead peer blocks -> Again
            s.connect(endpoint)
            self.socks[endpoint] = s
        self.socks[endpoint].setsockopt(zmq.SNDTIMEO, timeout_ms)
        return self.socks[endpoint]

    @torch.inference_mode()
    def send(self, cmd: SendCmd) -> dict:
        """{"sums": {dst_rank: checksum streams}, "error": None or why}. A destination that does not
        drain (dead decode rank) is an error for this room only: its socket and queued frames are
        dropped and the reply says so; raising would break the whole prefill rank group."""
        sums: dict[int, RoomChecksum] = {}
        seq: dict[int, int] = {}
        corrupt = cmd.corrupt
        for t in (t for t in cmd.plan if t.src_rank == self.rank):
            header, payload, rows = self._pack(cmd, t, seq)
            sums.setdefault(t.dst_rank, RoomChecksum()).update(self.rank, t.layer, t.kind, rows)
            if corrupt:
                payload[0] ^= 0x01  # after checksumming: as if flipped in flight
                corrupt = False
            endpoint = cmd.endpoints[t.dst_rank]
            if not endpoint.startswith("tcp://"):  # e.g. a NIXL decode instance: a clear error, not a ZMQError
                return {"sums": {}, "error": f"decode rank {t.dst_rank} offers a non-tcp endpoint {endpoint[:12]!r}..."}
            try:
                self._sock(endpoint, cmd.send_timeout_ms).send_multipart([msgpack.packb(header), payload])
            except zmq.Again:
                self.socks.pop(endpoint).close()  # LINGER 0: its queued frames go with it
                return {"sums": {}, "error": f"decode rank {t.dst_rank} at {endpoint} is not receiving"}
        return {"sums": {dst: dict(c.streams) for dst, c in sums.items()}, "error": None}

    def status(self) -> dict:
        return {"open_rooms": 0, "peers": len(self.socks)}  # a send holds nothing once it returned

    def _pack(self, cmd: SendCmd, t: Transfer, seq: dict[int, int]) -> tuple[dict, bytearray, torch.Tensor]:
        """(header, payload, the payload's [rows, width] view): the rows in run order."""
        width = (self.pool.kv if t.kind == "kv" else self.pool.index_k).shape[-1]
        payload = bytearray(t.rows * width * self.pool.dtype.itemsize)
        rows = torch.frombuffer(payload, dtype=torch.uint8).view(self.pool.dtype).view(t.rows, width) \
            if payload else torch.empty(0, width, dtype=self.pool.dtype)
        pack_rows(self.pool, t.kind, t.layer, t.runs, rows)
        header = {"room": cmd.room, "ticket": cmd.ticket, "src_rank": self.rank, "layer": t.layer, "kind": t.kind,
                  "runs": [[r.dst, r.length] for r in t.runs], "dtype": str(rows.dtype), "width": rows.shape[1],
                  "seq": seq.get(t.dst_rank, 0)}
        seq[t.dst_rank] = seq.get(t.dst_rank, 0) + 1
        return header, payload, rows

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.ctx.term()


class SendError(RuntimeError):
    """A prefill rank could not deliver its share of a room (the rank itself is fine)."""


def merge_checksums(replies: list[dict]) -> dict[int, int]:
    """Per decode rank, one checksum over every prefill rank's streams (what the receiver computes);
    SendError if any rank failed to send."""
    errors = [f"prefill rank {rank}: {r['error']}" for rank, r in enumerate(replies) if r["error"]]
    if errors:
        raise SendError("; ".join(errors))
    merged: dict[int, RoomChecksum] = {}
    for reply in replies:
        for dst, streams in reply["sums"].items():
            merged.setdefault(dst, RoomChecksum()).streams.update(streams)
    return {dst: c.value() for dst, c in merged.items()}
