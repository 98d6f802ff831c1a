"""NIXL data path of a KV hand-off (UCX backend, host DRAM): prefill ranks WRITE rows straight into
the decode rank's KV pool (or, for an fp8 pool, into a receive region the decode rank copies from);
the decode rank checks and counts them.

The receiving side is here, the sending side (NixlSender) in transfer/nixl_send.py. Same commands
and replies as transfer/tcp.py (StageCmd, ExpectCmd, TransferStatusCmd, ForgetCmd on
the receiver, SendCmd on the sender) and the same `RoomChecksum` streams, so the hand-off state
machines (prefill_room.py, decode_room.py) run unchanged over either backend.

    decode rank   one NIXL agent. POOL landing (`direct`, whenever the pool stores the dtype that
                  travels, i.e. not fp8): the pool's tensors are registered (again, with a new
                  generation, after a reconfigure replaced them) and StageCmd answers the endpoint
                  "nixl:" + base64(msgpack [agent, generation, agent metadata, 0, 0, pool layout]):
                  the address, rows per layer, row bytes and layer -> row map of the latent entries
                  and of the index keys, from which a sender computes where each destination run
                  lands. REGION landing (fp8 pools, or direct=False): one receive ARENA (a uint8
                  tensor) registered once; StageCmd carves a REGION for the room out of it, sized for
                  exactly the rows this rank will store (in the dtype that travels), and answers
                  [agent, generation, metadata, region address, region size, None].
    prefill rank  one agent; one send STAGING buffer and its KV pool, registered once. Per decode
                  rank it sends its transfers (plan order, rows in run order) in chunks of at most
                  CHUNK_BYTES, ONE WRITE per (sender, receiver) pair per chunk, each posted as soon
                  as it is laid out, every one waited for before the send returns (so chunks may
                  land in any order: each carries its offset, by which the receiver orders their
                  checksum, RoomChecksum). Rows sent from the pool are hashed where they lie (keyed
                  row hashes on their device, transfer/row_mac.py), not copied.
                  A chunk's rows that lie in consecutive pool rows (KVPool.span: a copied index's
                  rows; a DCP rank's latent rows when the pool is residue-major by C_d) go straight
                  from the pool, one descriptor per run; other rows are packed into staging first
                  (descriptors of adjacent bytes merge, local and remote pieces are paired to equal
                  lengths). The chunk's notification is its header: room, ticket, src_rank, offset in
                  the region, bytes, dtype, items [layer, kind, width, dst runs]. Each sender's offset
                  in a region follows from the plan every rank holds (the same decode rank's
                  transfers from lower prefill ranks come first): senders never overlap. A
                  streamed send (the prefill posts each layer's rows as it stores them) keeps
                  its offset running from post to post, so offsets still order its chunks.
    completion    by notification. No progress thread (docs/nixl.md: it busy-spins a core): the
                  receiver thread polls get_new_notifs, sleeping BUSY_POLL_S between empty polls
                  while a room is open and IDLE_POLL_S otherwise; the sender polls check_xfer_state
                  of every WRITE it posted, with SEND_POLL_S sleeps, until each is DONE, failed or
                  past its deadline (then cancelled); packed staging is reused only after that.

A notification is authentic only with a valid HMAC trailer under the cluster frame key
(frames.seal_notif; dropped and counted otherwise, before it is decoded), and its header must be
the protocol's (room.check_notif). A notified chunk counts only when it names a room that is open
with the SAME ticket (128 random bits per reservation), every destination run lies in the room's
own pages (room.RoomSlots, from the reservation: anything else fails the room) and it fits the
rank's layout and the rows still expected (room.frame_rows); then its rows are hashed where they now are (pool landing: in the pool,
nothing to copy; region landing: copied into the pool first, then hashed from the region, so
bytes that change during the copy fail the room). A room's request runs only after every row
arrived and its room MAC (RoomChecksum: keyed row hashes under the cluster frame key, folded by
row_mac.fold) equals the sender's, which comes in the authenticated TransferDone: rows changed on
the way (an on-path attacker rewriting a WRITE) fail the room before anything of it is committed.

Stale writes (docs/design.md 3.7-3.8). A one-sided WRITE cannot be refused by its target. What a room's
senders may still write into -- its pool pages, or its region -- is not reused while a sender can
still write there:
  - ForgetCmd(quiesced=True): the caller knows every sender returned (the decode room once the prefill
    answered), and a sender returns only when each of its WRITEs is DONE
    or was cancelled (release_xfer_handle): reusable at once;
  - otherwise a region stays quarantined until every row the room expected has been notified (late
    notifications are counted, then dropped) or `quarantine_s` passed; and ForgetCmd answers
    ForgetReply(hold_s=quarantine_s) for a pool-landing room, which DecodeInstance.forget passes on: the
    engine frees the request's pages with that hold (PageAllocator.free), so no other request gets
    them before the quarantine ends.
So a late WRITE lands in memory no other room owns, and its notification is dropped. A prefill
rank's pool is registered only as the source of its own WRITEs: no decode rank loads a prefill
agent's metadata. A decode rank's agent metadata (which lets its holder WRITE into the registered
pool) travels only inside reservations, and a decode client sends those only to a side-channel peer
that proved it holds the cluster key (transfer/side_channel.py: Hello / Welcome). A pool-landing
WRITE itself cannot be refused: what a notification claims is checked, so a peer that writes
outside its room fails that room.

Peers: a sender loads a decode agent's metadata once per (name, generation), the generation being
that agent's creation time in ns. A newer generation replaces it (remove_remote_agent first: NIXL
refuses to re-add a name), an older one is refused, and a peer whose WRITE failed is removed so the
next reservation loads it afresh. Failures release what they hold: xfer handles (cancelling in-flight
WRITEs), the room's region, the peer. Idle counters: TransferStatusCmd (decode) and SenderStatusCmd (prefill).
"""

from __future__ import annotations

import atexit
import dataclasses
import threading
import time
from dataclasses import dataclass

import torch

from .base import RoomChecksum
from .frames import DEV_FRAME_KEY, HEADER_MAX_BYTES, Liveness, open_notif, unpack
from .nixl_agent import Arena, NixlEndpoint, agent_name, bind_device, make_agent, mem_type
from .rank_commands import ExpectCmd, ForgetCmd, ForgetReply, StageCmd, StageReply, receive_command
from .room_rows import DTYPES, RoomRows, RoomStatus, check_notif, count_rows, frame_rows, store_rows

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
    direct: bool = False  # WRITEs land in the pool's rows (no region)

    def status(self) -> RoomStatus:
        s = super().status()
        return dataclasses.replace(s, complete=s.complete and self.expecting)

    @property
    def lands(self) -> bool:
        """Senders can WRITE for this room: into the pool (direct) or into its region."""
        return self.direct or self.start >= 0

    def all_notified(self) -> bool:
        return self.expecting and self.notified >= sum(self.expected.values())


def _rows_named(h: dict) -> int:
    """Rows a checked notification names."""
    return sum(n for item in h["items"] for _, n in item[3])


class NixlReceiver:
    """One per decode rank: its agent, its receive arena and the thread that stores notified chunks."""

    def __init__(
        self,
        rank: int,
        pool,
        staging_bytes: int = 256 << 20,
        name: str | None = None,
        quarantine_s: float = QUARANTINE_S,
        direct: bool = True,
        key: bytes = DEV_FRAME_KEY,
    ):
        self.rank, self.pool, self.quarantine_s = (
            rank,
            pool,
            quarantine_s,
        )  # pool(): the rank's current KVPool
        self.key = key  # notifications must carry a valid tag under it
        self.direct = direct  # land WRITEs in the pool when it stores the dtype that travels (not fp8)
        self.pool_regs: list = []
        self.pool_key: tuple | None = None  # the registered pool's tensors (address, bytes)
        self.name, self.generation = name or agent_name("decode", rank), time.time_ns()
        self.agent = make_agent(self.name)
        device = pool().kv.device  # the arena lives where the pool does: VRAM on cuda
        self.buf = torch.empty(
            staging_bytes, dtype=torch.uint8, device=device
        )  # never zeroed: written before read
        self.mem, self.dev = mem_type(self.buf), self.buf.device.index or 0
        self.reg = self.agent.register_memory(self.buf)
        self.metadata = self.agent.get_agent_metadata()
        self.arena = Arena(staging_bytes)
        self.endpoint = f"nixl:{self.name}"  # what info() shows; each room's endpoint comes from StageCmd
        self.lock = threading.Lock()
        self.rooms: dict[str, _Room] = {}
        self.quarantine: dict[
            int, tuple[str, _Room]
        ] = {}  # ticket -> forgotten room whose region may be written
        self.frames = 0  # notified chunks stored
        self.dropped = 0  # notifications for rooms not open (late or stale): ignored by design
        self.unauthenticated = self.bad_frames = 0  # no valid tag / authentic but not the protocol's header
        self._stop = threading.Event()
        self.live = Liveness(f"NIXL notification receiver of rank {rank}")
        self.thread = self.live.thread = threading.Thread(
            target=self._loop, name=f"kv-nixl-recv-{rank}", daemon=True
        )
        self.thread.start()
        atexit.register(self.close)  # stop polling before the interpreter tears the agent down

    def handle(self, cmd):
        return receive_command(self, cmd)

    def forget(self, cmd: ForgetCmd) -> ForgetReply:
        return self._drop(cmd.room, cmd.quiesced)

    def _row_bytes(self, kind: str) -> int:
        pool = self.pool()
        return (pool.kv if kind == "kv" else pool.index_k).shape[-1] * pool.dtype.itemsize

    def stage(self, cmd: StageCmd) -> StageReply:
        size = sum(n * self._row_bytes(kind) for kind, n in cmd.rows.get(self.rank, {}).items())
        self._drop(cmd.room, quiesced=False)  # an earlier use of the room id may still be written
        if (layout := self._pool_layout()) is not None:
            self.rooms[cmd.room] = _Room(cmd.ticket, {}, checksum=RoomChecksum(key=self.key), direct=True)
            ep = NixlEndpoint(self.name, self.generation, self.metadata, 0, 0, layout, self.mem, self.dev)
            return StageReply(ep.encode())
        got = self.arena.alloc(size)
        if got is None:
            return StageReply(
                None,
                f"receive staging full: room {cmd.room} needs {size} bytes, "
                f"{self.arena.size - self.arena.used} of {self.arena.size} free "
                f"({len(self.quarantine)} regions quarantined)",
            )
        start, length = got
        self.rooms[cmd.room] = _Room(
            cmd.ticket, {}, checksum=RoomChecksum(key=self.key), start=start, length=length, size=size
        )
        ep = NixlEndpoint(
            self.name,
            self.generation,
            self.metadata,
            self.buf.data_ptr() + start,
            size,
            None,
            self.mem,
            self.dev,
        )
        return StageReply(ep.encode())

    def _pool_layout(self) -> list | None:
        """Where senders WRITE in this rank's pool (NixlEndpoint.pool), registering the pool first
        (again after a reconfigure replaced it: a new generation makes senders reload the metadata);
        None when WRITEs go to regions instead."""
        pool = self.pool()
        if not self.direct or pool.fp8:
            return None
        tensors = [t for t in (pool.kv, pool.index_k) if t.numel()]
        key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
        if key != self.pool_key:
            for reg in self.pool_regs:
                self.agent.deregister_memory(reg)
            self.pool_regs, self.pool_key = [self.agent.register_memory(t) for t in tensors], key
            self.metadata, self.generation = self.agent.get_agent_metadata(), time.time_ns()

        def side(t: torch.Tensor, rows: dict[int, int]) -> list:
            return [t.data_ptr(), t.shape[1], t.shape[-1] * t.element_size(), sorted(rows.items())]

        return side(pool.kv, pool.kv_row) + side(pool.index_k, pool.index_row)

    def expect(self, cmd: ExpectCmd) -> None:
        expected = dict(cmd.expected.get(self.rank, {}))
        r = self.rooms.get(cmd.room)
        if r is not None and r.ticket == cmd.ticket:
            r.expected, r.expecting, r.slots = expected, True, cmd.slots
            return
        self._drop(cmd.room, quiesced=False)
        self.rooms[cmd.room] = _Room(
            cmd.ticket, expected, cmd.slots, checksum=RoomChecksum(key=self.key), expecting=True
        )  # no region: nothing can land for it

    def _drop(self, room: str, quiesced: bool) -> ForgetReply:
        """Forgets the room; how long its pool pages must stay unused -- non-zero for a
        direct room whose senders may still be writing (DecodeInstance.forget)."""
        r = self.rooms.pop(room, None)
        if r is None or not r.lands:
            return ForgetReply()
        if quiesced or r.all_notified():
            if not r.direct:
                self.arena.release(r.start, r.length)
            return ForgetReply()
        r.until = time.monotonic() + self.quarantine_s
        self.quarantine[r.ticket] = (room, r)  # counts its late notifications
        return ForgetReply(self.quarantine_s if r.direct else 0.0)

    def counters(self) -> dict:
        return {
            "staging_bytes": self.arena.used,
            "quarantined": len(self.quarantine),
            "registered_regions": 1 if self.reg is not None else 0,
            "registered_pool": len(self.pool_regs),
        }

    def _loop(self) -> None:
        bind_device(self.buf)
        while not self._stop.is_set():
            self.live.beat()
            try:
                notifs = self.agent.get_new_notifs()
            except Exception:  # a broken peer connection; its rooms time out on the decode side
                notifs = {}
            with self.lock:
                for msgs in notifs.values():
                    for msg in msgs:
                        try:
                            self._on_notif(msg)
                        except Exception:  # never expected (notifications are checked): the thread goes on
                            self.live.crashes += 1
                self._expire()
                busy = bool(self.rooms)
            if not notifs:
                time.sleep(BUSY_POLL_S if busy else IDLE_POLL_S)

    def _expire(self) -> None:
        now = time.monotonic()
        for ticket, (_, r) in list(self.quarantine.items()):
            if r.until <= now or r.all_notified():
                del self.quarantine[ticket]
                if not r.direct:
                    self.arena.release(r.start, r.length)

    def _on_notif(self, msg: bytes) -> None:
        header = open_notif(self.key, msg)
        if header is None or len(header) > HEADER_MAX_BYTES:
            self.unauthenticated += 1
            return
        try:
            h = check_notif(unpack(header, HEADER_MAX_BYTES))
        except Exception:
            self.bad_frames += 1
            return
        room, ticket = h["room"], h["ticket"]
        r = self.rooms.get(room)
        if r is None or r.ticket != ticket or not r.lands:
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
            self.frames += 1
        except (ValueError, KeyError, TypeError, RuntimeError) as e:
            r.error = f"bad chunk from prefill rank {h.get('src_rank')}: {e}"

    def _store(self, r: _Room, h: dict) -> None:
        if r.direct:
            return self._landed(r, h)
        offset, nbytes = h["offset"], h["nbytes"]
        if not (
            isinstance(offset, int) and isinstance(nbytes, int) and 0 <= offset and offset + nbytes <= r.size
        ):
            raise ValueError(f"chunk [{offset}, +{nbytes}) outside the room's region of {r.size} bytes")
        start, pos, pool = r.start + offset, 0, self.pool()
        for item in _items(h):
            dtype = DTYPES[h["dtype"]]
            n = sum(length for _, length in item["runs"]) * item["width"] * dtype.itemsize
            if pos + n > nbytes:
                raise ValueError(f"items need more than the chunk's {nbytes} bytes")
            if (start + pos) % dtype.itemsize:
                raise ValueError(
                    f"item at region offset {offset + pos} is not aligned to its dtype {h['dtype']}"
                )
            rows = frame_rows(pool, r, item, n)
            data = self.buf[start + pos : start + pos + n].view(dtype).view(rows, item["width"])
            store_rows(pool, r, item, data)  # straight from the region, checksummed after the store
            pos += n
        if pos != nbytes:
            raise ValueError(f"items cover {pos} of the chunk's {nbytes} bytes")

    def _landed(self, r: _Room, h: dict) -> None:
        """A chunk WRITTEN into the pool's rows: checks it as a region chunk is checked, then
        counts and checksums the rows where they landed (nothing to copy)."""
        pool = self.pool()
        for item in _items(h):
            if DTYPES.get(h["dtype"]) != pool.dtype:
                raise ValueError(f"rows of dtype {h['dtype']} for a pool of {pool.dtype}")
            kind, layer, runs = item["kind"], item["layer"], item["runs"]
            frame_rows(pool, r, item, sum(n for _, n in runs) * item["width"] * pool.dtype.itemsize)
            count_rows(r, item, [pool.span(kind, layer, dst, n, 1) for dst, n in runs if n])

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.thread.join(2.0)
        for reg in ([self.reg] if self.reg is not None else []) + self.pool_regs:
            self.agent.deregister_memory(reg)
        self.reg, self.pool_regs = None, []


def _items(h: dict):
    """Each (layer, kind, width, runs) of a notification as the item dict the frame checks take;
    its order is the chunk's byte offset, then the item's place in the chunk (chunks WRITTEN
    together may land in any order)."""
    for i, (layer, kind, width, runs) in enumerate(h["items"]):
        yield {
            "order": (h["offset"], i),
            "src_rank": h["src_rank"],
            "dtype": h["dtype"],
            "layer": layer,
            "kind": kind,
            "width": width,
            "runs": runs,
        }
