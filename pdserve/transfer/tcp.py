"""TCP data path of a KV hand-off: prefill ranks PUSH packed rows, decode ranks PULL and store them.

Wire: one ZMQ multipart message per piece of a transfer (src_rank, dst_rank, layer, kind) of the
plan -- at most DATA_PAYLOAD_MAX bytes and DATA_RUNS_MAX runs each (transfer/frames.py; `pieces`):
    [msgpack header, payload, tag]
    header  {room, ticket, src_rank, layer, kind, runs: [[dst_start, length], ...], dtype, width, seq}
    payload the rows in run order, contiguous [rows, width] of `dtype` (raw bytes).
    tag     HMAC-SHA256 of the header and the payload bytes under the cluster frame key
            (transfer/frames.py): checked first; a frame without a valid tag is dropped, undecoded,
            and nothing of it is stored.
One PUSH socket per destination endpoint (cached), so frames to one decode rank arrive in the
order they were sent; `seq` counts frames per (room, destination) for debugging.

The rank commands (transfer/rank_commands.py), the room bookkeeping (`RoomRows`) and the frame
checks (transfer/room_rows.py: `check_header`, `frame_rows`, `store_rows`) are shared with the NIXL data
path (transfer/nixl.py), which honours the same commands.

Receiver invariants (docs/design.md 3.7-3.8):
  - rows are written into the pool ONLY for a room that is currently expected with the same ticket
    (`ExpectCmd`); anything else (late data of an aborted room, an old reuse of the room id) is
    dropped and counted, never stored where a live request could decode it;
  - a frame that does not fit (dtype, width, rows out of range, rows outside the room's own pages
    (`RoomSlots`), more rows than expected) marks the room failed and is not written;
  - no frame stops the receiver thread: wrong part counts, tags, msgpack, field types and sizes are
    counted and dropped; the PULL socket's MAXMSGSIZE is the largest legitimate frame
    (DATA_FRAME_MAX, whatever the pool's size) and it queues at most RECV_QUEUE messages per
    connection, so a peer without the key makes a receiver hold at most (RECV_QUEUE + 1) x
    DATA_FRAME_MAX per connection before their tags fail; `ListenerStatusCmd` says whether the
    thread lives (for /health);
  - per room: rows received vs expected and its room MAC (`RoomChecksum`, keyed) over the stored
    rows, which the hand-off compares with the senders' (`TransferStatusCmd`); `ForgetCmd` drops the room.
The receiver thread and the rank's command loop share the room table: one lock guards it.
"""

from __future__ import annotations

import threading
from typing import Callable

import msgpack
import torch
import zmq

from ..runtime.faults import take as take_fault
from .base import RoomChecksum, SendClock
from .frames import (
    DATA_FRAME_MAX,
    DATA_PAYLOAD_MAX,
    DATA_RUNS_MAX,
    DEV_FRAME_KEY,
    HEADER_MAX_BYTES,
    Liveness,
    data_ok,
    seal_data,
    unpack,
)
from .plan import Transfer
from .rank_commands import (
    ExpectCmd,
    ForgetCmd,
    ForgetReply,
    SendCmd,
    SendReply,
    StageCmd,
    StageReply,
    receive_command,
)
from .room_rows import (
    SLICE_RUNS,
    RoomRows,
    check_header,
    frame_rows,
    payload_rows,
    run_rows,
    store_rows,
)


def pack_rows(pool, kind: str, layer: int, runs, out: torch.Tensor) -> None:
    """Reads the source rows of `runs` (plan Runs, rows in run order) into `out` [rows, width]:
    strided slice copies for a few runs, one gather for many."""
    if len(runs) > SLICE_RUNS:
        pool.read_into(
            kind,
            layer,
            run_rows([r.src for r in runs], [r.length for r in runs], [r.step for r in runs]),
            out,
        )
        return
    pos = 0
    for r in runs:
        pool.read_into(
            kind, layer, slice(r.src, r.src + (r.length - 1) * r.step + 1, r.step), out[pos : pos + r.length]
        )
        pos += r.length


RECV_QUEUE = 4  # whole messages a receiver queues per connection (ZMQ_RCVHWM)


def pieces(runs: list[list[int]], row_bytes: int) -> list[tuple[int, int, list[list[int]]]]:
    """A transfer's destination runs [[dst, length], ...] (rows in run order) cut into frames of at
    most DATA_PAYLOAD_MAX bytes and DATA_RUNS_MAX runs: [(first row, end row, the frame's runs)]; a
    run may be split between two frames."""
    rows_max = max(1, DATA_PAYLOAD_MAX // max(1, row_bytes))
    out, cur, start, n = [], [], 0, 0
    for dst, length in runs:
        while length:
            take = min(length, rows_max - n)
            cur.append([dst, take])
            dst, length, n = dst + take, length - take, n + take
            if n == rows_max or len(cur) == DATA_RUNS_MAX:
                out.append((start, start + n, cur))
                cur, start, n = [], start + n, 0
    if cur or not out:
        out.append((start, start + n, cur))
    return out


class TcpReceiver:
    """One per decode rank: a PULL socket on 127.0.0.1 (ephemeral port) and the thread that drains it."""

    def __init__(
        self,
        rank: int,
        pool: Callable[[], object],
        host: str = "127.0.0.1",
        key: bytes = DEV_FRAME_KEY,
    ):
        self.rank, self.pool, self.key = (
            rank,
            pool,
            key,
        )  # pool(): the rank's current KVPool (reconfigure replaces it)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, DATA_FRAME_MAX)  # a larger frame disconnects its sender
        self.sock.setsockopt(zmq.RCVHWM, RECV_QUEUE)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.lock = threading.Lock()
        self.rooms: dict[str, RoomRows] = {}
        self.frames = 0  # frames stored
        self.dropped = 0  # frames for rooms not expected (late or stale): ignored by design
        self.unauthenticated = 0  # frames without a valid tag
        self.bad_frames = 0  # authentic frames whose header is not the protocol's
        self._stop = threading.Event()
        self.live = Liveness(f"KV receiver of rank {rank}")
        self.thread = self.live.thread = threading.Thread(
            target=self._loop, name=f"kv-recv-{rank}", daemon=True
        )
        self.thread.start()

    def handle(self, cmd):
        return receive_command(self, cmd)

    def stage(self, cmd: StageCmd) -> StageReply:
        return StageReply(self.endpoint)  # one socket for every room

    def expect(self, cmd: ExpectCmd) -> None:
        self.rooms[cmd.room] = RoomRows(
            cmd.ticket, dict(cmd.expected.get(self.rank, {})), cmd.slots, checksum=RoomChecksum(key=self.key)
        )

    def forget(self, cmd: ForgetCmd) -> ForgetReply:
        self.rooms.pop(cmd.room, None)
        return ForgetReply()  # nothing lands in the pool but through this rank's own checks

    def counters(self) -> dict:
        return {}

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            self.live.beat()
            try:
                if poller.poll(100):
                    self._take(self.sock.recv_multipart(copy=True))
            except Exception:  # never expected (frames are checked): the thread must go on
                self.live.crashes += 1

    def _take(self, parts: list[bytes]) -> None:
        """One received message: authenticated, decoded, checked, stored -- or counted and dropped."""
        if (
            len(parts) != 3
            or len(parts[0]) > HEADER_MAX_BYTES
            or not data_ok(self.key, parts[0], parts[1], parts[2])
        ):
            with self.lock:
                self.unauthenticated += 1
            return
        try:
            h = check_header(unpack(parts[0], HEADER_MAX_BYTES))
        except Exception:
            with self.lock:
                self.bad_frames += 1
            return
        with self.lock:  # held while writing: status never sees half a frame
            self._on_frame(h, parts[1])

    def _on_frame(self, h: dict, payload: bytes) -> None:
        r = self.rooms.get(h["room"])
        if r is None or r.ticket != h["ticket"] or r.error is not None:
            self.dropped += 1
            return
        try:
            rows = frame_rows(self.pool(), r, h, len(payload))
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            r.error = f"bad frame from prefill rank {h['src_rank']}: {e}"
            return
        store_rows(self.pool(), r, h, payload_rows(bytearray(payload), h, rows))
        self.frames += 1

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2.0)
        self.sock.close()
        self.ctx.term()


class TcpSender:
    """One per prefill rank: packs its share of a plan per (layer, kind) and PUSHes it."""

    def __init__(self, rank: int, pool: object, key: bytes = DEV_FRAME_KEY):
        self.rank, self.pool, self.key = rank, pool, key
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}
        self.clock = SendClock()
        self._cmd: SendCmd | None = None  # the open send (`open` .. `close_send`)
        self._sums: dict[int, RoomChecksum] = {}
        self._seq: dict[int, int] = {}
        self._corrupt, self._error = False, None

    def _sock(self, endpoint: str, timeout_ms: int) -> zmq.Socket:
        if endpoint not in self.socks:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)  # a dead receiver must not block shutdown
            s.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a live connection: a dead peer blocks -> Again
            s.connect(endpoint)
            self.socks[endpoint] = s
        self.socks[endpoint].setsockopt(zmq.SNDTIMEO, timeout_ms)
        return self.socks[endpoint]

    def send(self, cmd: SendCmd) -> SendReply:
        """The room's SendReply (per decode rank, checksum streams; or why it stopped). A destination that does not
        drain (dead decode rank) is an error for this room only: its socket and queued frames are
        dropped and the reply says so; raising would break the whole prefill rank group."""
        self.open(cmd)
        self.post(cmd.plan)
        return self.close_send()

    def open(self, cmd: SendCmd) -> None:
        """Begins a send whose transfers come in pieces (`post`, as the prefill computes them)."""
        self.clock.__enter__()
        self._cmd, self._sums, self._seq, self._error = cmd, {}, {}, None
        self._corrupt = take_fault("corrupt", cmd.room)  # test-only (runtime/faults.py)

    @torch.inference_mode()
    def post(self, transfers: list[Transfer]) -> None:
        """Sends this rank's transfers among these (the open send's); after a failure, nothing."""
        for t in (t for t in transfers if t.src_rank == self.rank):
            if self._error is None:
                self._error = self._send_one(t)

    def settle_posted(self) -> None:
        """Nothing to wait for: every posted frame is queued on its socket (ZMQ sends it)."""

    def close_send(self) -> SendReply:
        """Ends the open send: its reply. The frames are queued on their sockets (ZMQ sends them)."""
        self.clock.__exit__()
        sums, err, self._sums = self._sums, self._error, {}
        if err:
            return SendReply(error=err)
        return SendReply({dst: dict(c.streams) for dst, c in sums.items()})

    def _send_one(self, t: Transfer) -> str | None:
        cmd, seq = self._cmd, self._seq
        header, payload, rows = self._pack(cmd, t)
        self._sums.setdefault(t.dst_rank, RoomChecksum(key=self.key)).update(self.rank, t.layer, t.kind, rows)
        if self._corrupt:
            payload[0] ^= 0x01  # after the room MAC, before the frame tag: a corrupt sender
            self._corrupt = False
        endpoint = cmd.endpoints[t.dst_rank]
        if not endpoint.startswith("tcp://"):  # e.g. a NIXL decode instance: a clear error, not a ZMQError
            return f"decode rank {t.dst_rank} offers a non-tcp endpoint {endpoint[:12]!r}..."
        row_bytes = rows.shape[1] * rows.element_size()
        try:
            sock = self._sock(endpoint, cmd.send_timeout_ms)
            for first, end, runs in pieces(header["runs"], row_bytes):
                piece = memoryview(payload)[first * row_bytes : end * row_bytes]
                packed = msgpack.packb({**header, "runs": runs, "seq": seq.get(t.dst_rank, 0)})
                seq[t.dst_rank] = seq.get(t.dst_rank, 0) + 1
                sock.send_multipart([packed, piece, seal_data(self.key, packed, piece)])
        except zmq.Again:
            self.socks.pop(endpoint).close()  # LINGER 0: its queued frames go with it
            return f"decode rank {t.dst_rank} at {endpoint} is not receiving"
        return None

    def status(self) -> dict:
        return {  # a send holds nothing once it returned; when the last one began and returned
            "open_rooms": 0,
            "peers": len(self.socks),
            **self.clock.status(),
        }

    def _pack(self, cmd: SendCmd, t: Transfer) -> tuple[dict, bytearray, torch.Tensor]:
        """(header without its seq, payload, the payload's [rows, width] view): the rows in run order."""
        width = (self.pool.kv if t.kind == "kv" else self.pool.index_k).shape[-1]
        payload = bytearray(t.rows * width * self.pool.dtype.itemsize)
        rows = (
            torch.frombuffer(payload, dtype=torch.uint8).view(self.pool.dtype).view(t.rows, width)
            if payload
            else torch.empty(0, width, dtype=self.pool.dtype)
        )
        pack_rows(self.pool, t.kind, t.layer, t.runs, rows)
        header = {
            "room": cmd.room,
            "ticket": cmd.ticket,
            "src_rank": self.rank,
            "layer": t.layer,
            "kind": t.kind,
            "runs": [[r.dst, r.length] for r in t.runs],
            "dtype": str(rows.dtype),
            "width": rows.shape[1],
        }
        return header, payload, rows

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.ctx.term()
