"""TCP data path of a KV hand-off: prefill ranks PUSH packed rows, decode ranks PULL and store them.

Wire: one ZMQ multipart message per transfer (src_rank, dst_rank, layer, kind) of the plan:
    [msgpack header, payload]
    header  {room, ticket, src_rank, layer, kind, runs: [[dst_start, length], ...], dtype, width, seq}
    payload the rows in run order, contiguous [rows, width] of `dtype` (raw bytes).
One PUSH socket per destination endpoint (cached), so frames to one decode rank arrive in the
order they were sent; `seq` counts frames per (room, destination) for debugging.

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
class TransferStatusCmd:
    room: str


@dataclass(frozen=True)
class ForgetCmd:
    room: str


@dataclass(frozen=True)
class SendCmd:
    """Prefill ranks: send the transfers of `plan` whose src_rank is this rank."""

    room: str
    ticket: int
    plan: list[Transfer]
    endpoints: dict[int, str]  # decode rank -> "tcp://host:port"
    corrupt: bool = False  # test hook: flip one payload byte after checksumming (checksum must catch it)
    send_timeout_ms: int = 10_000  # a destination that accepts nothing for this long is dead for this room


TRANSFER_CMDS = (ExpectCmd, TransferStatusCmd, ForgetCmd)
ANY_SRC = -1


@dataclass
class _Room:
    ticket: int
    expected: dict[int, int]  # src_rank -> rows
    received: dict[int, int] = field(default_factory=dict)
    checksum: RoomChecksum = field(default_factory=RoomChecksum)
    error: str | None = None


def _count_key(r: _Room, src: int) -> int:
    return src if src in r.expected else ANY_SRC


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
        self.rooms: dict[str, _Room] = {}
        self.dropped = 0  # frames for rooms not expected (late or stale): ignored by design
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"kv-recv-{rank}", daemon=True)
        self.thread.start()

    def handle(self, cmd):
        with self.lock:
            if isinstance(cmd, ExpectCmd):
                self.rooms[cmd.room] = _Room(cmd.ticket, dict(cmd.expected.get(self.rank, {})))
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
        if r is None:
            return {**base, "known": False}
        rows, expected = sum(r.received.values()), sum(r.expected.values())
        return {**base, "known": True, "rows": rows, "expected": expected, "complete": rows == expected,
                "checksum": r.checksum.value(), "error": r.error}

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
            rows, data = self._unpack(h, payload, r)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            r.error = f"bad frame from prefill rank {h.get('src_rank')}: {e}"
            return
        pool = self.pool()
        if h["kind"] == "kv":
            pool.write_kv(h["layer"], rows, data)
        else:
            pool.write_index(h["layer"], rows, data)
        key = _count_key(r, h["src_rank"])
        r.received[key] = r.received.get(key, 0) + len(rows)
        r.checksum.update(h["src_rank"], h["layer"], h["kind"], payload)

    def _unpack(self, h: dict, payload: bytes, r: _Room) -> tuple[torch.Tensor, torch.Tensor]:
        pool, layer, src = self.pool(), h["layer"], h["src_rank"]
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
        runs = [torch.arange(d, d + n) for d, n in h["runs"]]
        rows = torch.cat(runs) if runs else torch.empty(0, dtype=torch.int64)
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= limit):
            raise ValueError(f"rows out of range [0, {limit})")
        key = _count_key(r, src)
        if r.received.get(key, 0) + len(rows) > r.expected.get(key, 0):
            raise ValueError(f"more rows than expected from prefill rank {src}")
        dtype = DTYPES[h["dtype"]]
        if len(payload) != len(rows) * width * dtype.itemsize:
            raise ValueError(f"payload of {len(payload)} bytes for {len(rows)} rows of width {width}")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(len(rows), width)
        return rows, data

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
            header, payload = self._pack(cmd, t, seq)
            sums.setdefault(t.dst_rank, RoomChecksum()).update(self.rank, t.layer, t.kind, payload)
            if corrupt:
                payload[0] ^= 0x01  # after checksumming: as if flipped in flight
                corrupt = False
            endpoint = cmd.endpoints[t.dst_rank]
            try:
                self._sock(endpoint, cmd.send_timeout_ms).send_multipart([msgpack.packb(header), bytes(payload)])
            except zmq.Again:
                self.socks.pop(endpoint).close()  # LINGER 0: its queued frames go with it
                return {"sums": {}, "error": f"decode rank {t.dst_rank} at {endpoint} is not receiving"}
        return {"sums": {dst: dict(c.streams) for dst, c in sums.items()}, "error": None}

    def _pack(self, cmd: SendCmd, t: Transfer, seq: dict[int, int]) -> tuple[dict, bytearray]:
        src = torch.cat([torch.arange(r.src, r.src + r.length) for r in t.runs])
        read = self.pool.read_kv if t.kind == "kv" else self.pool.read_index
        rows = read(t.layer, src).contiguous()  # [rows, width] in run order
        header = {"room": cmd.room, "ticket": cmd.ticket, "src_rank": self.rank, "layer": t.layer, "kind": t.kind,
                  "runs": [[r.dst, r.length] for r in t.runs], "dtype": str(rows.dtype), "width": rows.shape[1],
                  "seq": seq.get(t.dst_rank, 0)}
        seq[t.dst_rank] = seq.get(t.dst_rank, 0) + 1
        return header, bytearray(rows.view(torch.uint8).numpy().tobytes())

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
