"""NIXL data path of a KV hand-off (UCX backend, host DRAM): prefill ranks WRITE rows into a receive
region that the decode rank reserved for the room; the decode rank checks and stores them.

The receiving side is here, the sending side (NixlSender) in transfer/nixl_send.py. Same commands
and replies as transfer/tcp.py (StageCmd, ExpectCmd, TransferStatusCmd, ForgetCmd on
the receiver, SendCmd on the sender) and the same `RoomChecksum` streams, so handoff.py and
two_sided.py run unchanged over either backend.

    decode rank   one NIXL agent and one receive ARENA (a uint8 tensor), registered once.
                  StageCmd carves a REGION for the room out of the arena, sized for exactly the rows
                  this rank will store (rows x row bytes of each kind, in the dtype that travels), and
                  answers the endpoint "nixl:" + base64(msgpack [agent, generation, agent metadata,
                  region address, region size]).
    prefill rank  one agent; one send STAGING buffer and its KV pool, registered once. Per decode
                  rank it sends its transfers (plan order, rows in run order) in chunks of at most
                  CHUNK_BYTES, ONE WRITE per (sender, receiver) pair per chunk, waiting for each.
                  A chunk's rows that lie in consecutive pool rows (KVPool.span: a copied index's
                  rows; a DCP rank's latent rows when the pool is residue-major by C_d) go straight
                  from the pool, one descriptor per run; other rows are packed into staging first
                  (descriptors of adjacent bytes merge). The chunk's notification is its header: room, ticket,
                  src_rank, offset in the region, bytes, dtype, items [layer, kind, width, dst runs].
                  Each sender's offset in a region follows from the plan every rank holds (the same
                  decode rank's transfers from lower prefill ranks come first): senders never overlap.
    completion    by notification. No progress thread (docs/nixl.md: it busy-spins a core): the
                  receiver thread polls get_new_notifs, sleeping BUSY_POLL_S between empty polls
                  while a room is open and IDLE_POLL_S otherwise; the sender polls check_xfer_state
                  with SEND_POLL_S sleeps until DONE, an error or its deadline (then it cancels).

Stale writes (DESIGN.md 3.7-3.8). A one-sided WRITE cannot be refused by its target, so no remote
agent ever writes into the KV pool: WRITEs land in the room's region, and the receiver thread copies
a chunk into the pool only when its notification names a room that is open with the SAME ticket
(every reservation gets a new ticket and a new region) and the chunk fits the region, the rank's
layout and the rows still expected (tcp.frame_rows). Rows go from the region into the pool in one
copy and are checksummed from the region AFTER that store: bytes that change in the region before or
during the store fail the room's checksum (verify_done), never decoded silently. (Only one of the
room's own senders could write there, and each writes its disjoint range once.)
A region returns to the arena only when no sender can still write into it:
  - ForgetCmd(quiesced=True): the caller knows every sender returned (hand_off after prefill.send,
    two_sided once the prefill answered), and a sender returns only when each of its WRITEs is DONE
    or was cancelled (release_xfer_handle);
  - or every row the room expected has been notified (a forgotten room's late notifications are
    counted, then dropped);
  - or `quarantine_s` passed since it was forgotten (a sender that never reported).
So a late WRITE lands in a region no other room owns, and its notification is dropped. A decode
rank's pool is not registered (nothing writes it remotely). A prefill rank's pool is registered
only as the source of its own WRITEs: no decode rank loads a prefill agent's metadata.

Peers: a sender loads a decode agent's metadata once per (name, generation), the generation being
that agent's creation time in ns. A newer generation replaces it (remove_remote_agent first: NIXL
refuses to re-add a name), an older one is refused, and a peer whose WRITE failed is removed so the
next reservation loads it afresh. Failures release what they hold: xfer handles (cancelling in-flight
WRITEs), the room's region, the peer. Idle counters: TransferStatusCmd on either side.
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass

import msgpack
import torch

from .nixl_agent import Arena, NixlEndpoint, agent_name, make_agent
from .tcp import DTYPES, ExpectCmd, ForgetCmd, RoomRows, StageCmd, TransferStatusCmd, frame_rows, store_rows

QUARANTINE_S = 60.0
BUSY_POLL_S, IDLE_POLL_S = 0.0005, 0.005


@dataclass
class _Room(RoomRows):
    start: int = -1  # the room's region: arena range [start, start + length), `size` bytes of it in use
    length: int = 0
    size: int = 0
    expecting: bool = False  # ExpectCmd came (before it, every row would be one too many)
    notified: int = 0  # rows named by notifications, stored or not (a forgotten room's too)
    until: float = 0.0  # end of the quarantine once forgotten

    def status(self) -> dict:
        s = super().status()
        s["complete"] = s["complete"] and self.expecting
        return s

    def all_notified(self) -> bool:
        return self.expecting and self.notified >= sum(self.expected.values())


def _rows_named(h: dict) -> int:
    try:
        return sum(int(n) for item in h["items"] for _, n in item[3])
    except (KeyError, TypeError, ValueError, IndexError):
        return 0


class NixlReceiver:
    """One per decode rank: its agent, its receive arena and the thread that stores notified chunks."""

    def __init__(self, rank: int, pool, staging_bytes: int = 256 << 20, name: str | None = None,
                 quarantine_s: float = QUARANTINE_S):
        self.rank, self.pool, self.quarantine_s = rank, pool, quarantine_s  # pool(): the rank's current KVPool
        self.name, self.generation = name or agent_name("decode", rank), time.time_ns()
        self.agent = make_agent(self.name)
        self.buf = torch.empty(staging_bytes, dtype=torch.uint8)  # never zeroed: regions are written before read
        self.reg = self.agent.register_memory(self.buf)
        self.metadata = self.agent.get_agent_metadata()
        self.arena = Arena(staging_bytes)
        self.endpoint = f"nixl:{self.name}"  # what info() shows; each room's endpoint comes from StageCmd
        self.lock = threading.Lock()
        self.rooms: dict[str, _Room] = {}
        self.quarantine: dict[int, tuple[str, _Room]] = {}  # ticket -> forgotten room whose region may be written
        self.dropped = 0  # notifications for rooms not open (late or stale): ignored by design
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"kv-nixl-recv-{rank}", daemon=True)
        self.thread.start()
        atexit.register(self.close)  # stop polling before the interpreter tears the agent down

    def handle(self, cmd):
        with self.lock:
            if isinstance(cmd, StageCmd):
                return self._stage(cmd)
            if isinstance(cmd, ExpectCmd):
                return self._expect(cmd)
            if isinstance(cmd, ForgetCmd):
                return self._drop(cmd.room, cmd.quiesced)
            if isinstance(cmd, TransferStatusCmd):
                return self._status(cmd.room)
        raise TypeError(f"unknown transfer command {type(cmd).__name__}")

    def _row_bytes(self, kind: str) -> int:
        pool = self.pool()
        return (pool.kv if kind == "kv" else pool.index_k).shape[-1] * pool.dtype.itemsize

    def _stage(self, cmd: StageCmd) -> dict:
        size = sum(n * self._row_bytes(kind) for kind, n in cmd.rows.get(self.rank, {}).items())
        self._drop(cmd.room, quiesced=False)  # an earlier use of the room id may still be written
        got = self.arena.alloc(size)
        if got is None:
            return {"endpoint": None, "error": f"receive staging full: room {cmd.room} needs {size} bytes, "
                                              f"{self.arena.size - self.arena.used} of {self.arena.size} free "
                                              f"({len(self.quarantine)} regions quarantined)"}
        start, length = got
        self.rooms[cmd.room] = _Room(cmd.ticket, {}, start=start, length=length, size=size)
        ep = NixlEndpoint(self.name, self.generation, self.metadata, self.buf.data_ptr() + start, size)
        return {"endpoint": ep.encode(), "error": None}

    def _expect(self, cmd: ExpectCmd) -> None:
        expected = dict(cmd.expected.get(self.rank, {}))
        r = self.rooms.get(cmd.room)
        if r is not None and r.ticket == cmd.ticket:
            r.expected, r.expecting = expected, True
            return
        self._drop(cmd.room, quiesced=False)
        self.rooms[cmd.room] = _Room(cmd.ticket, expected, expecting=True)  # no region: nothing can land for it

    def _drop(self, room: str, quiesced: bool) -> None:
        r = self.rooms.pop(room, None)
        if r is None or r.start < 0:
            return
        if quiesced or r.all_notified():
            self.arena.release(r.start, r.length)
        else:
            r.until = time.monotonic() + self.quarantine_s
            self.quarantine[r.ticket] = (room, r)

    def _status(self, room: str) -> dict:
        r = self.rooms.get(room)
        base = {"open_rooms": len(self.rooms), "dropped": self.dropped, "staging_bytes": self.arena.used,
                "quarantined": len(self.quarantine), "registered_regions": 1 if self.reg is not None else 0}
        return {**base, **(r.status() if r else {"known": False})}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self.agent.get_new_notifs()
            except Exception:  # a broken peer connection; its rooms time out on the decode side
                notifs = {}
            with self.lock:
                for msgs in notifs.values():
                    for msg in msgs:
                        self._on_notif(msg)
                self._expire()
                busy = bool(self.rooms)
            if not notifs:
                time.sleep(BUSY_POLL_S if busy else IDLE_POLL_S)

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket, (_, r) in list(self.quarantine.items()):
            if r.until <= now or r.all_notified():
                del self.quarantine[ticket]
                self.arena.release(r.start, r.length)

    def _on_notif(self, msg: bytes) -> None:
        try:
            h = msgpack.unpackb(msg, raw=False)
            room, ticket = h["room"], h["ticket"]
        except Exception:
            self.dropped += 1
            return
        r = self.rooms.get(room)
        if r is None or r.ticket != ticket or r.start < 0:
            late = self.quarantine.get(ticket)
            if late is not None and late[0] == room:
                late[1].notified += _rows_named(h)  # that sender is done with this chunk of the region
            self.dropped += 1
            return
        r.notified += _rows_named(h)
        if r.error is not None:  # the room failed: nothing more of it is stored
            self.dropped += 1
            return
        try:
            self._store(r, h)
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            r.error = f"bad chunk from prefill rank {h.get('src_rank')}: {e}"

    def _store(self, r: _Room, h: dict) -> None:
        offset, nbytes = h["offset"], h["nbytes"]
        if not (isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset and offset + nbytes <= r.size):
            raise ValueError(f"chunk [{offset}, +{nbytes}) outside the room's region of {r.size} bytes")
        start, pos, pool = r.start + offset, 0, self.pool()
        for layer, kind, width, runs in h["items"]:
            item = {"src_rank": h["src_rank"], "dtype": h["dtype"], "layer": layer, "kind": kind, "width": width,
                    "runs": runs}
            dtype = DTYPES[h["dtype"]]
            n = sum(length for _, length in runs) * width * dtype.itemsize
            if pos + n > nbytes:
                raise ValueError(f"items need more than the chunk's {nbytes} bytes")
            if (start + pos) % dtype.itemsize:
                raise ValueError(f"item at region offset {offset + pos} is not aligned to its dtype {h['dtype']}")
            rows = frame_rows(pool, r, item, n)
            data = self.buf[start + pos:start + pos + n].view(dtype).view(rows, width)
            store_rows(pool, r, item, data)  # straight from the region, checksummed after the store
            pos += n
        if pos != nbytes:
            raise ValueError(f"items cover {pos} of the chunk's {nbytes} bytes")

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.thread.join(2.0)
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
            self.reg = None
