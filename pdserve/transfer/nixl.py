"""NIXL data path of a KV hand-off (UCX backend, host DRAM): prefill ranks WRITE packed rows into a
receive region that the decode rank reserved for the room; the decode rank checks and stores them.

Same commands and replies as transfer/tcp.py (StageCmd, ExpectCmd, TransferStatusCmd, ForgetCmd on
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
import itertools
import threading
import time
from dataclasses import dataclass

import msgpack
import torch

from .base import RoomChecksum
from .nixl_agent import Arena, NixlEndpoint, agent_name, make_agent
from .plan import Run, Transfer
from .tcp import (DTYPES, ExpectCmd, ForgetCmd, RoomRows, SendCmd, StageCmd, TransferStatusCmd, frame_rows,
                  pack_rows, store_rows)

QUARANTINE_S = 60.0
BUSY_POLL_S, IDLE_POLL_S, SEND_POLL_S = 0.0005, 0.005, 0.0001
CHUNK_BYTES = 8 << 20  # per WRITE: small enough that receivers store while senders still pack
DIRECT_RUN_BYTES = 16 << 10  # runs this long on average are WRITTEN from the pool (one descriptor each)


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


def _add_piece(pieces: list, addr: int, nbytes: int) -> None:
    """Appends local bytes [addr, addr + nbytes) to a WRITE's pieces, merged with the last when adjacent."""
    if pieces and pieces[-1][0] + pieces[-1][1] == addr:
        pieces[-1][1] += nbytes
    else:
        pieces.append([addr, nbytes])


def slice_runs(runs: tuple[Run, ...], start: int, n: int) -> list[Run]:
    """The runs covering packed rows [start, start + n) of a transfer (rows in run order)."""
    out, pos, end = [], 0, start + n
    for r in runs:
        a, b = max(start, pos), min(end, pos + r.length)
        if a < b:
            out.append(Run(r.src + (a - pos) * r.step, r.dst + a - pos, b - a, r.step))
        pos += r.length
        if pos >= end:
            break
    return out


class NixlSender:
    """One per prefill rank: WRITEs its share of a plan, from its pool or packed into staging."""

    def __init__(self, rank: int, pool, staging_bytes: int = 64 << 20, name: str | None = None,
                 chunk_bytes: int = CHUNK_BYTES):
        self.rank, self.pool, self.chunk_bytes = rank, pool, min(chunk_bytes, staging_bytes)
        self.name = name or agent_name("prefill", rank)
        self.agent = make_agent(self.name)
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8)
        self.reg = self.agent.register_memory(self.staging)
        # The pool too, so rows that lie contiguously in it (KVPool.span) are WRITTEN without packing.
        self.pool_regs = [] if pool.fp8 else [self.agent.register_memory(t) for t in (pool.kv, pool.index_k) if t.numel()]
        self.peers: dict[str, int] = {}  # decode agent -> generation whose metadata is loaded
        self.handles = 0  # xfer handles not yet released
        self.stuck: list = []  # handles NIXL could not release (never expected; shown by status)
        self.staging_used = 0
        self.reloads = 0  # peers replaced by a newer generation
        self.bytes_direct = self.bytes_packed = 0  # sent straight from the pool / packed into staging first

    def status(self) -> dict:
        return {"open_rooms": 0, "xfer_handles": self.handles, "stuck": len(self.stuck),
                "staging_bytes": self.staging_used, "registered_regions": 1 if self.reg is not None else 0,
                "registered_pool": len(self.pool_regs), "peers": len(self.peers), "reloads": self.reloads,
                "bytes_direct": self.bytes_direct, "bytes_packed": self.bytes_packed}

    def _row_bytes(self, kind: str) -> int:
        return (self.pool.kv if kind == "kv" else self.pool.index_k).shape[-1] * self.pool.dtype.itemsize

    @torch.inference_mode()
    def send(self, cmd: SendCmd) -> dict:
        """{"sums": {dst_rank: checksum streams}, "error": None or why}, like TcpSender.send. Returns
        only when every WRITE it posted is DONE or cancelled; a failed destination fails the room only."""
        mine = [t for t in cmd.plan if t.src_rank == self.rank]
        sums: dict[int, RoomChecksum] = {}
        corrupt = [cmd.corrupt]
        dsts = sorted({t.dst_rank for t in mine})
        dsts = dsts[self.rank % len(dsts):] + dsts[:self.rank % len(dsts)] if dsts else []  # ranks start apart
        try:
            for dst in dsts:
                err = self._send_to(cmd, dst, [t for t in mine if t.dst_rank == dst], sums, corrupt)
                if err:
                    return {"sums": {}, "error": f"decode rank {dst}: {err}"}
        finally:
            self.staging_used = 0
        return {"sums": {dst: dict(c.streams) for dst, c in sums.items()}, "error": None}

    def _send_to(self, cmd: SendCmd, dst: int, transfers: list[Transfer], sums: dict, corrupt: list) -> str | None:
        try:
            ep = NixlEndpoint.decode(cmd.endpoints[dst])
        except Exception as e:
            return f"bad endpoint: {type(e).__name__}: {e}"
        if err := self._load_peer(ep):
            return err
        offset = sum(t.rows * self._row_bytes(t.kind) for t in cmd.plan if t.dst_rank == dst and t.src_rank < self.rank)
        need = sum(t.rows * self._row_bytes(t.kind) for t in transfers)
        if offset + need > ep.size:
            return f"its region of {ep.size} bytes cannot take {need} bytes at offset {offset} (layout mismatch?)"
        checksum = sums.setdefault(dst, RoomChecksum())
        pos, spos, items, pieces = 0, 0, [], []  # chunk bytes, staging bytes, headers, local [addr, bytes]
        for t in transfers:
            rb, done = self._row_bytes(t.kind), 0
            while done < t.rows:
                n = min(t.rows - done, (self.chunk_bytes - pos) // rb)
                if n == 0:
                    if not items:
                        return f"send chunks of {self.chunk_bytes} bytes hold no row of {rb} bytes"
                    if err := self._write(cmd, ep, offset, pos, items, pieces):
                        return err
                    offset, pos, spos, items, pieces = offset + pos, 0, 0, [], []
                    continue
                runs = slice_runs(t.runs, done, n)
                direct = not corrupt[0] and (len(runs) == 1 or n * rb >= len(runs) * DIRECT_RUN_BYTES)  # long runs
                views = [self.pool.span(t.kind, t.layer, r.src, r.length, r.step) for r in runs] if direct else None
                if views is None or any(v is None for v in views):  # pack into staging
                    rows = self.staging[spos:spos + n * rb].view(self.pool.dtype).view(n, -1)
                    pack_rows(self.pool, t.kind, t.layer, runs, rows)
                    views, spos = [rows], spos + n * rb
                    self.bytes_packed += n * rb
                else:
                    self.bytes_direct += n * rb
                for rows in views:
                    checksum.update(self.rank, t.layer, t.kind, rows)
                    _add_piece(pieces, rows.data_ptr(), rows.numel() * rows.element_size())
                if corrupt[0]:
                    self.staging[spos - n * rb] ^= 0x01  # after checksumming: as if flipped in flight
                    corrupt[0] = False
                items.append([t.layer, t.kind, views[0].shape[1], [[r.dst, r.length] for r in runs]])
                pos, done = pos + n * rb, done + n
                self.staging_used = spos
        return self._write(cmd, ep, offset, pos, items, pieces) if items else None

    def _load_peer(self, ep: NixlEndpoint) -> str | None:
        known = self.peers.get(ep.agent)
        if known == ep.generation:
            return None
        if known is not None and ep.generation < known:
            return f"stale endpoint: agent {ep.agent} generation {ep.generation} is older than the loaded {known}"
        if known is not None:
            self._forget_peer(ep.agent)  # a restarted peer: never write through the old handle
            self.reloads += 1
        try:
            name = self.agent.add_remote_agent(ep.metadata)
        except Exception as e:
            return f"cannot load agent {ep.agent}: {type(e).__name__}: {e}"
        name = name.decode() if isinstance(name, bytes) else name
        if name != ep.agent:
            self._forget_peer(name)
            return f"endpoint names agent {ep.agent} but its metadata is agent {name}"
        self.peers[ep.agent] = ep.generation
        return None

    def _forget_peer(self, agent: str) -> None:
        self.peers.pop(agent, None)
        try:
            self.agent.remove_remote_agent(agent)
        except Exception:
            pass  # not loaded (or already gone): nothing to release

    def _write(self, cmd: SendCmd, ep: NixlEndpoint, offset: int, nbytes: int, items: list,
               pieces: list) -> str | None:
        """One WRITE of the local pieces (staging or pool, nbytes in all) to the region's bytes
        [offset, offset + nbytes), its header as notification; waits."""
        notif = msgpack.packb({"room": cmd.room, "ticket": cmd.ticket, "src_rank": self.rank, "offset": offset,
                               "nbytes": nbytes, "dtype": str(self.pool.dtype), "items": items})
        deadline = time.monotonic() + cmd.send_timeout_ms / 1000
        h, err = None, None
        try:
            starts = itertools.accumulate((n for _, n in pieces), initial=ep.addr + offset)
            local = self.agent.get_xfer_descs([(addr, n, 0) for addr, n in pieces], "DRAM")
            remote = self.agent.get_xfer_descs([(start, n, 0) for (_, n), start in zip(pieces, starts)], "DRAM")
            h = self.agent.initialize_xfer("WRITE", local, remote, ep.agent, notif)
            self.handles += 1
            state = self.agent.transfer(h)
            while state == "PROC":
                if time.monotonic() > deadline:
                    state = f"not done within {cmd.send_timeout_ms} ms (cancelled)"
                    break
                time.sleep(SEND_POLL_S)
                state = self.agent.check_xfer_state(h)
            err = None if state == "DONE" else f"WRITE to {ep.agent} {state}"
        except Exception as e:
            err = f"WRITE to {ep.agent} failed: {type(e).__name__}: {e}"
        finally:
            if h is not None:
                self._release(h)
        if err:
            self._forget_peer(ep.agent)  # dead or stuck: the next reservation loads it afresh
        return err

    def _release(self, h) -> None:
        """Releases (cancels, when in flight) a handle; one NIXL cannot cancel is waited out for 1 s."""
        for attempt in range(2):
            try:
                self.agent.release_xfer_handle(h)
                self.handles -= 1
                return
            except Exception:
                deadline = time.monotonic() + 1.0
                while attempt == 0 and time.monotonic() < deadline and self._state(h) == "PROC":
                    time.sleep(0.001)
        self.stuck.append(h)

    def _state(self, h) -> str:
        try:
            return self.agent.check_xfer_state(h)
        except Exception:
            return "ERR"

    def close(self) -> None:
        for agent in list(self.peers):
            self._forget_peer(agent)
        if self.reg is not None:
            for reg in [self.reg] + self.pool_regs:
                self.agent.deregister_memory(reg)
            self.reg, self.pool_regs = None, []
