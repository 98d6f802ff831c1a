"""NIXL data path, sending side: a prefill rank WRITEs its share of a hand-off plan into the regions
the decode ranks reserved, from its KV pool where the rows are contiguous there and packed into a
registered staging buffer otherwise. The protocol, the receiving side and the stale-write rules are
in transfer/nixl.py."""

from __future__ import annotations

import dataclasses
import time

import msgpack
import torch

from ..runtime.faults import take as take_fault
from .base import RoomChecksum, SendClock
from .frames import DEV_FRAME_KEY, seal_notif
from .nixl_agent import NixlEndpoint, agent_name, make_agent, mem_type
from .plan import Run, Transfer
from .rank_commands import SendCmd, SendReply
from .row_mac import row_macs
from .tcp import pack_rows

SEND_POLL_S = 0.0001
# per WRITE; a send's WRITEs are in flight together, and fewer, larger ones cost less CPU
CHUNK_BYTES = 32 << 20
DIRECT_RUN_BYTES = 16 << 10  # runs this long on average are WRITTEN from the pool (one descriptor each)


def _add_piece(pieces: list, addr: int, nbytes: int) -> None:
    """Appends local bytes [addr, addr + nbytes) to a WRITE's pieces, merged with the last when adjacent."""
    if pieces and pieces[-1][0] + pieces[-1][1] == addr:
        pieces[-1][1] += nbytes
    else:
        pieces.append([addr, nbytes])


def _pair(local: list, remote: list, local_dev: int = 0, remote_dev: int = 0) -> tuple[list, list]:
    """Two descriptor lists of equal-length pairs covering the same bytes in order (a WRITE pairs
    its local and remote descriptors one to one). A descriptor's device id is the GPU ordinal for
    VRAM (0 for host memory)."""
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise ValueError("local and remote pieces differ in size")
    src, dst, i, j = [], [], 0, 0
    (la, ln), (ra, rn) = local[0], remote[0]
    while True:
        n = min(ln, rn)
        src.append((la, n, local_dev))
        dst.append((ra, n, remote_dev))
        la, ln, ra, rn = la + n, ln - n, ra + n, rn - n
        if ln == 0:
            i += 1
            if i == len(local):
                return src, dst
            la, ln = local[i]
        if rn == 0:
            j += 1
            ra, rn = remote[j]


class _PoolLayout:
    """A decode rank's pool as NixlEndpoint.pool describes it: where a row of a layer lands."""

    def __init__(self, fields: list, row_bytes: dict[str, int]):
        kv_addr, kv_rows, kv_rb, kv_layers, ix_addr, ix_rows, ix_rb, ix_layers = fields
        self.sides = {
            "kv": (kv_addr, kv_rows, kv_rb, dict(kv_layers)),
            "index": (ix_addr, ix_rows, ix_rb, dict(ix_layers)),
        }
        for kind, (_, _, rb, _) in self.sides.items():
            if rb != row_bytes[kind] and self.sides[kind][3]:
                raise ValueError(
                    f"its pool's {kind} rows are {rb} bytes, ours {row_bytes[kind]} (layout mismatch?)"
                )

    def addr(self, kind: str, layer: int, row: int, n: int) -> int:
        base, rows, rb, layers = self.sides[kind]
        if layer not in layers or row < 0 or row + n > rows:
            raise ValueError(f"its pool has no {kind} rows [{row}, +{n}) of layer {layer} (layout mismatch?)")
        return base + (layers[layer] * rows + row) * rb


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


@dataclasses.dataclass
class _Posted:
    """One WRITE in flight: its handle, where it goes, when it is given up."""

    h: object
    agent: str
    dst: int
    deadline: float
    timeout_ms: int
    state: str = "PROC"


class NixlSender:
    """One per prefill rank: WRITEs its share of a plan, from its pool or packed into staging."""

    def __init__(
        self,
        rank: int,
        pool,
        *,
        key: bytes = DEV_FRAME_KEY,
        chunk_bytes: int = CHUNK_BYTES,
        name: str | None = None,
        staging_bytes: int = 64 << 20,
    ):
        self.rank, self.pool, self.chunk_bytes = rank, pool, min(chunk_bytes, staging_bytes)
        self.key = key  # notifications carry an HMAC trailer under it (frames.seal_notif)
        self.name = name or agent_name("prefill", rank)
        self.agent = make_agent(self.name)
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=pool.kv.device)  # VRAM on cuda
        self.mem = mem_type(self.staging)
        self.reg = self.agent.register_memory(self.staging)
        # The pool too, so rows that lie contiguously in it (KVPool.span) are WRITTEN without packing,
        # their row hashes taken as the pool stores them (off the hand-off's path) and read here.
        self.pool_regs = (
            [] if pool.fp8 else [self.agent.register_memory(t) for t in (pool.kv, pool.index_k) if t.numel()]
        )
        if not pool.fp8:
            pool.keep_row_hashes(lambda rows: row_macs(key, rows))
        self.peers: dict[str, int] = {}  # decode agent -> generation whose metadata is loaded
        self.handles = 0  # xfer handles not yet released
        self.stuck: list = []  # handles NIXL could not release (never expected; shown by status)
        self.staging_used = 0
        self.reloads = 0  # peers replaced by a newer generation
        self.bytes_direct = self.bytes_packed = 0  # sent straight from the pool / packed into staging first
        self.inflight: list[_Posted] = []  # WRITEs posted and not yet settled
        self.failure: str | None = None  # the first WRITE of this send that failed
        self.clock = SendClock()
        # the open send (`open` .. `close_send`): its command, checksums, corrupt hook, each
        # destination's next region offset, the error that stopped its posting
        self._cmd: SendCmd | None = None
        self._sums: dict[int, RoomChecksum] = {}
        self._corrupt = [False]
        self._offsets: dict[int, int] = {}
        self._error: str | None = None

    def status(self) -> dict:
        return {
            "open_rooms": 0,
            "xfer_handles": self.handles,
            "stuck": len(self.stuck),
            "staging_bytes": self.staging_used,
            "registered_regions": 1 if self.reg is not None else 0,
            "registered_pool": len(self.pool_regs),
            "peers": len(self.peers),
            "reloads": self.reloads,
            "bytes_direct": self.bytes_direct,
            "bytes_packed": self.bytes_packed,
            **self.clock.status(),
        }

    def _row_bytes(self, kind: str) -> int:
        return (self.pool.kv if kind == "kv" else self.pool.index_k).shape[-1] * self.pool.dtype.itemsize

    def send(self, cmd: SendCmd) -> SendReply:
        """The room's SendReply (per decode rank, checksum streams; or why it stopped), like TcpSender.send. Every
        WRITE is posted as soon as its chunk is laid out (none waits for the one before); returns
        only when every WRITE it posted is DONE or cancelled; a failed destination fails the room only."""
        self.open(cmd)
        self.post(cmd.plan)
        return self.close_send()

    def open(self, cmd: SendCmd) -> None:
        """Begins a send whose transfers come in pieces (`post`, as the prefill computes them);
        cmd.plan is the whole plan (every rank's region offsets follow from it)."""
        self.clock.__enter__()
        self._cmd, self._sums = cmd, {}
        self._corrupt = [take_fault("corrupt", cmd.room)]  # test-only (runtime/faults.py)
        self._offsets, self._error, self.failure = {}, None, None

    @torch.inference_mode()
    def post(self, transfers: list[Transfer]) -> None:
        """Posts the WRITEs of this rank's transfers among these, without waiting for them (they
        settle in close_send, or when the staging is needed again); after a failure, nothing."""
        mine = [t for t in transfers if t.src_rank == self.rank]
        dsts = sorted({t.dst_rank for t in mine})
        dsts = (
            dsts[self.rank % len(dsts) :] + dsts[: self.rank % len(dsts)] if dsts else []
        )  # ranks start apart
        for dst in dsts:
            self._error = self._error or self.failure  # a WRITE of an earlier post failed
            if self._error is not None:
                return
            group = [t for t in mine if t.dst_rank == dst]
            if err := self._send_to(self._cmd, dst, group, self._sums, self._corrupt):
                self._error = self.failure or f"decode rank {dst}: {err}"
        self._settle(block=False)  # releases the WRITEs already done

    def settle_posted(self) -> None:
        """Waits until every WRITE posted so far is DONE, failed or cancelled (the send stays open),
        then progresses the agent once more (what a DONE WRITE's notification may still need)."""
        self._settle()
        self.agent.get_new_notifs()

    def close_send(self) -> SendReply:
        """Ends the open send once every WRITE it posted is DONE or cancelled: its reply."""
        try:
            self._settle()
        finally:
            err = self.failure or self._error  # a WRITE that failed, else the error that stopped posting
            self.staging_used = 0
            self.clock.__exit__()
        if err:
            return SendReply(error=err)
        return SendReply({dst: dict(c.streams) for dst, c in self._sums.items()})

    def _send_to(
        self, cmd: SendCmd, dst: int, transfers: list[Transfer], sums: dict, corrupt: list
    ) -> str | None:
        try:
            ep = NixlEndpoint.decode(cmd.endpoints[dst])
        except Exception as e:
            return f"bad endpoint: {type(e).__name__}: {e}"
        if err := self._load_peer(ep):
            return err
        if dst not in self._offsets:  # this rank's place in the region: after lower ranks' rows
            rb = self._row_bytes
            base = sum(t.rows * rb(t.kind) for t in cmd.plan if t.dst_rank == dst and t.src_rank < self.rank)
            need = sum(t.rows * rb(t.kind) for t in cmd.plan if t.dst_rank == dst and t.src_rank == self.rank)
            if ep.pool is None and base + need > ep.size:
                return f"its region of {ep.size} bytes cannot take {need} bytes at offset {base} (layout mismatch?)"
            self._offsets[dst] = base
        offset = self._offsets[dst]
        try:
            dest = _PoolLayout(ep.pool, {k: self._row_bytes(k) for k in ("kv", "index")}) if ep.pool else None
        except ValueError as e:
            return str(e)
        checksum = sums.setdefault(dst, RoomChecksum(key=self.key))
        pos, items, pieces = 0, [], []  # chunk bytes, headers, local [addr, bytes]
        remote: list | None = [] if dest else None  # pool destinations: remote [addr, bytes] per run
        for t in transfers:
            rb, done = self._row_bytes(t.kind), 0
            while done < t.rows:
                if pos == 0 and self.staging_used + self.chunk_bytes > self.staging.numel():
                    # a chunk packs at most chunk_bytes: the staging is reused once its WRITEs are done
                    if not self._settle():
                        return "a WRITE failed"
                    self.staging_used = 0
                n = min(t.rows - done, (self.chunk_bytes - pos) // rb)
                if n == 0:
                    if not items:
                        return f"send chunks of {self.chunk_bytes} bytes hold no row of {rb} bytes"
                    if err := self._write(cmd, ep, dst, offset, pos, items, pieces, remote):
                        return err
                    offset, pos, items, pieces = offset + pos, 0, [], []
                    self._offsets[dst] = offset
                    remote = [] if dest else None
                    continue
                runs = slice_runs(t.runs, done, n)
                direct = not corrupt[0] and (
                    len(runs) == 1 or n * rb >= len(runs) * DIRECT_RUN_BYTES
                )  # long runs
                views = (
                    [self.pool.span(t.kind, t.layer, r.src, r.length, r.step) for r in runs]
                    if direct
                    else None
                )
                if views is None or any(v is None for v in views):  # pack into staging
                    spos = self.staging_used
                    rows = self.staging[spos : spos + n * rb].view(self.pool.dtype).view(n, -1)
                    pack_rows(self.pool, t.kind, t.layer, runs, rows)
                    checksum.update(self.rank, t.layer, t.kind, rows)
                    if corrupt[0]:
                        self.staging[spos] ^= 0x01  # after checksumming: as if flipped in flight
                        corrupt[0] = False
                    views, self.staging_used = [rows], spos + n * rb
                    self.bytes_packed += n * rb
                else:
                    for r in runs:  # their hashes, taken as the pool stored them (KVPool.keep_row_hashes)
                        kept = self.pool.span_hashes(t.kind, t.layer, r.src, r.length, r.step)
                        checksum.add_hashes(self.rank, t.layer, t.kind, kept.clone())
                    self.bytes_direct += n * rb
                for rows in views:
                    _add_piece(pieces, rows.data_ptr(), rows.numel() * rows.element_size())
                items.append([t.layer, t.kind, views[0].shape[1], [[r.dst, r.length] for r in runs]])
                if dest:
                    try:
                        for r in runs:
                            _add_piece(remote, dest.addr(t.kind, t.layer, r.dst, r.length), r.length * rb)
                    except ValueError as e:
                        return str(e)
                pos, done = pos + n * rb, done + n
        self._offsets[dst] = offset + pos
        return self._write(cmd, ep, dst, offset, pos, items, pieces, remote) if items else None

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

    def _write(
        self,
        cmd: SendCmd,
        ep: NixlEndpoint,
        dst: int,
        offset: int,
        nbytes: int,
        items: list,
        pieces: list,
        remote: list | None = None,
    ) -> str | None:
        """Posts one WRITE of the local pieces (staging or pool, nbytes in all) to the region's bytes
        [offset, offset + nbytes) -- or, with `remote`, to those pieces of the decode pool -- its
        header as notification; `_settle` waits for it."""
        notif = seal_notif(
            self.key,
            msgpack.packb(
                {
                    "room": cmd.room,
                    "ticket": cmd.ticket,
                    "src_rank": self.rank,
                    "offset": offset,
                    "nbytes": nbytes,
                    "dtype": str(self.pool.dtype),
                    "items": items,
                }
            ),
        )
        deadline = time.monotonic() + cmd.send_timeout_ms / 1000
        try:
            if remote is None:
                remote = [[ep.addr + offset, nbytes]]  # the region: contiguous
            src, dst_descs = _pair(pieces, remote, self.staging.device.index or 0, ep.dev)
            if self.staging.is_cuda:  # the packing kernels must have finished before NIXL reads
                torch.cuda.current_stream(self.staging.device).synchronize()
            h = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(src, self.mem),
                self.agent.get_xfer_descs(dst_descs, ep.mem),
                ep.agent,
                notif,
            )
        except Exception as e:
            self._forget_peer(ep.agent)  # dead or stuck: the next reservation loads it afresh
            return f"WRITE to {ep.agent} failed: {type(e).__name__}: {e}"
        self.handles += 1
        self.inflight.append(_Posted(h, ep.agent, dst, deadline, cmd.send_timeout_ms))
        try:
            state = self.agent.transfer(h)
        except Exception as e:
            state = f"failed: {type(e).__name__}: {e}"
        self.inflight[-1].state = state
        return None if state in ("PROC", "DONE") else f"WRITE to {ep.agent} {state}"  # stop posting

    def _settle(self, block: bool = True) -> bool:
        """Waits until every posted WRITE is DONE, failed or past its deadline (then cancelled) and
        releases each (block=False: only those that already are; the others stay in flight); False
        when one failed (the first failure is kept in self.failure as the room's error, its peer
        forgotten)."""
        failed, pending = set(), self.inflight
        while pending:
            waiting = []
            for w in pending:
                if w.state == "PROC":
                    w.state = self._state(w.h)
                if w.state == "PROC" and time.monotonic() <= w.deadline:
                    waiting.append(w)
                    continue
                if w.state == "PROC":
                    w.state = f"not done within {w.timeout_ms} ms (cancelled)"
                if w.state != "DONE":
                    self.failure = self.failure or f"decode rank {w.dst}: WRITE to {w.agent} {w.state}"
                    failed.add(w.agent)
                self._release(w.h)
            pending = waiting
            if pending and not block:
                break
            if pending:
                time.sleep(SEND_POLL_S)
        self.inflight = pending
        for agent in failed:
            self._forget_peer(agent)  # dead or stuck: the next reservation loads it afresh
        return not failed

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
