"""bench/transfer.py's ceilings for the hand-off: raw NIXL WRITEs over the pairs the hand-off uses.

A hand-off from C_p prefill ranks into C_d decode ranks moves, over each (prefill rank, decode rank)
pair its plan uses, that pair's bytes; all pairs at once. Its fair ceiling is therefore not one raw
pair but the same pairs at once, each WRITEing the same bytes: `RawPairs` keeps one sender process
per prefill rank and one receiver process per decode rank, and each `round` posts every pair's
WRITE together from a common start, timed until every receiver has seen every notification. Every
side polls with 0.2 ms sleeps, as the hand-off's loops do (4 processes spinning on 2 cores starve
each other). Nothing is packed, stored or checksummed: this is what the transport gives these
processes on this machine. Both ends' buffers are allocated as the KV pools are (kvcache/huge_pages.py:
2 MiB-aligned, on transparent huge pages where the kernel has them), so the raw rate is that of the
same kind of memory as the hand-off's.

`round(verify=True)` adds the one thing a hand-off must do that a raw WRITE does not (invariant 8,
docs/design.md): each receiver reads every byte that landed once, taking its row sums (`row_sums`:
the cheapest read of every byte; the hand-off itself now runs a keyed MAC, transfer/row_mac.py,
which costs more) as each sender's WRITE is notified. That is the floor of any verified transfer
over this transport here, measured rather than estimated.

`round(..., chunk_bytes=C)` splits each pair's bytes into WRITEs of at most C bytes (whole rows), all
in flight together, each with a notification of its own, and a verifying receiver reads each chunk
as soon as it is notified, as the hand-off's receivers do (its senders WRITE 32 MB chunks):
bench/transfer_floor.py asks whether any chunk size lets that read overlap the copies enough.

The processes live across rounds, so `Interleaved` runs their rounds between the hand-off's
(bench/transfer.py; bench/ is on sys.path when a script runs)."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch
from common import cpu_seconds

from pdserve.kvcache import huge_pages

POLL_S = 0.0002  # the hand-off's own status polls sleep too
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """[n] int64: per row of [n, ...], the wrapping int64 sum of its bytes, read as words of the
    widest integer type that divides the row's byte size."""
    b = rows.reshape(len(rows), -1).contiguous().view(torch.uint8)
    if b.numel() == 0:
        return torch.zeros(len(b), dtype=torch.int64, device=b.device)
    size, word = next((n, t) for n, t in _WORDS if b.shape[1] % n == 0)
    if b.storage_offset() % size or b.data_ptr() % size:
        b = b.clone()  # a view at an odd offset: word loads need alignment
    return b.view(word).sum(1, dtype=torch.int64)


def pieces(offset: int, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """A pair's bytes [offset, offset + nbytes) in a receiver as the WRITEs that carry them: chunks of
    chunk_bytes (the last one shorter), or one WRITE when chunk_bytes is 0."""
    if chunk_bytes <= 0:
        return [(offset, nbytes)]
    return [(offset + i, min(chunk_bytes, nbytes - i)) for i in range(0, nbytes, chunk_bytes)]


def piece_tag(tag: bytes, offset: int) -> bytes:
    """The notification of the WRITE landing at `offset`; NIXL matches tags as prefixes, so it ends in ";"."""
    return tag + b"@%d;" % offset


def _receiver(conn, idx: int, nbytes: int, row_bytes: int) -> None:
    from pdserve.transfer.nixl_agent import make_agent

    torch.set_num_threads(1)
    buf = huge_pages.zeros(max(nbytes, 1), dtype=torch.uint8)  # the memory kind of the KV pools
    agent = make_agent(f"raw-recv-{idx}")
    reg = agent.register_memory(buf)
    conn.send({"md": agent.get_agent_metadata(), "addr": buf.data_ptr()})
    while True:
        cmd = conn.recv()
        if cmd[0] != "wait":
            agent.deregister_memory(reg)
            conn.send("bye")
            return
        _, pending, verify = cmd  # pending: {(sender agent name, tag): (offset, bytes)}
        pending = {tuple(k): v for k, v in pending}
        conn.send("ready")
        total = 0  # verify: the sum of every landed row's sum (what the read saw)
        while pending:  # polls with short sleeps: 4 spinning processes would starve each other on 2 cores
            for key in [k for k in pending if agent.check_remote_xfer_done(*k)]:
                off, n = pending.pop(key)
                if verify:  # read what landed once, as a hand-off's receiver checksums its rows
                    rows, tail = divmod(n, row_bytes)
                    total += int(row_sums(buf[off : off + rows * row_bytes].view(rows, row_bytes)).sum())
                    if tail:  # index rows are narrower: the bytes after the last whole row, as one row
                        total += int(row_sums(buf[off + n - tail : off + n].view(1, tail)).sum())
            if pending:
                time.sleep(POLL_S)
        conn.send((time.perf_counter(), total if verify else None))


def _sender(conn, idx: int, targets: list[tuple[int, int, int]], receivers: list[dict]) -> None:
    """targets: (receiver, offset in its buffer, bytes) of each pair this sender WRITEs."""
    from pdserve.transfer.nixl_agent import make_agent

    torch.set_num_threads(1)
    total = sum(n for _, _, n in targets)
    src = huge_pages.zeros(max(total, 1), dtype=torch.uint8)  # the memory kind of the KV pools
    src.copy_(torch.arange(src.numel(), dtype=torch.int64) % 251)
    agent = make_agent(f"raw-send-{idx}")
    reg = agent.register_memory(src)
    peers = {d: agent.add_remote_agent(receivers[d]["md"]) for d, _, _ in targets}
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] != "go":
            agent.deregister_memory(reg)
            conn.send("bye")
            return
        _, tag, start, chunk_bytes = cmd
        handles, pos = [], 0
        for d, off, n in targets:
            for at, m in pieces(off, n, chunk_bytes):
                handles.append(
                    agent.initialize_xfer(
                        "WRITE",
                        agent.get_xfer_descs([(src.data_ptr() + pos + at - off, m, 0)], "DRAM"),
                        agent.get_xfer_descs([(receivers[d]["addr"] + at, m, 0)], "DRAM"),
                        peers[d],
                        piece_tag(tag, at),
                    )
                )
            pos += n
        while time.perf_counter() < start:
            time.sleep(POLL_S)
        states = [agent.transfer(h) for h in handles]
        while any(s == "PROC" for s in states):
            time.sleep(POLL_S)
            states = [agent.check_xfer_state(h) if s == "PROC" else s for h, s in zip(handles, states)]
        for h in handles:
            agent.release_xfer_handle(h)
        conn.send(states)


class RawPairs:
    """Sender and receiver processes for raw WRITEs of pair_bytes[(sender, receiver)] bytes each."""

    def __init__(self, pair_bytes: dict[tuple[int, int], int], row_bytes: int):
        ctx = mp.get_context("spawn")
        self.pairs = {k: v for k, v in sorted(pair_bytes.items()) if v > 0}
        self.row_bytes = row_bytes
        senders = sorted({s for s, _ in self.pairs})
        receivers = sorted({d for _, d in self.pairs})
        offsets, size = {}, dict.fromkeys(receivers, 0)
        for (s, d), n in self.pairs.items():  # senders' bytes lie one after another in a receiver
            offsets[(s, d)], size[d] = size[d], size[d] + n
        self.offsets = offsets
        self.rpipes, self.spipes, self.procs = {}, {}, []
        for d in receivers:
            a, b = ctx.Pipe()
            p = ctx.Process(target=_receiver, args=(b, d, size[d], row_bytes), daemon=True)
            p.start()
            self.rpipes[d] = a
            self.procs.append(p)
        infos = {d: a.recv() for d, a in self.rpipes.items()}
        info_list = [infos.get(d) for d in range(max(receivers) + 1)]
        for s in senders:
            a, b = ctx.Pipe()
            targets = [(d, offsets[(s, d)], n) for (s2, d), n in self.pairs.items() if s2 == s]
            p = ctx.Process(target=_sender, args=(b, s, targets, info_list), daemon=True)
            p.start()
            self.spipes[s] = a
            self.procs.append(p)
        for a in self.spipes.values():
            a.recv()
        self.rounds = 0
        self.round(False)  # warms up the connections; not timed

    @property
    def nbytes(self) -> int:
        return sum(self.pairs.values())

    def round(self, verify: bool, chunk_bytes: int = 0) -> float:
        """Seconds from the common start until every receiver saw (and, verify: read) every WRITE;
        `self.sums` then holds each receiver's sum of the row sums it read (verify) or None.
        chunk_bytes: each pair's bytes go as WRITEs of at most that many bytes, rounded down to whole
        rows (0: one WRITE per pair)."""
        if chunk_bytes:
            chunk_bytes = max(chunk_bytes // self.row_bytes, 1) * self.row_bytes
        self.rounds += 1
        tag = f"raw{self.rounds}".encode()
        for d, a in self.rpipes.items():
            waits = [
                ((f"raw-send-{s}", piece_tag(tag, at)), (at, m))
                for (s, d2), n in self.pairs.items()
                if d2 == d
                for at, m in pieces(self.offsets[(s, d2)], n, chunk_bytes)
            ]
            a.send(("wait", waits, verify))
            a.recv()
        start = time.perf_counter() + 0.02
        for a in self.spipes.values():
            a.send(("go", tag, start, chunk_bytes))
        states = [a.recv() for a in self.spipes.values()]
        if any(s != "DONE" for st in states for s in st):
            raise RuntimeError(f"raw NIXL WRITE ended {states}")
        done = {d: a.recv() for d, a in self.rpipes.items()}
        self.sums = {d: total for d, (_, total) in done.items()}
        return max(t for t, _ in done.values()) - start

    def close(self) -> None:
        for a in list(self.rpipes.values()) + list(self.spipes.values()):
            a.send(("quit",))
            a.recv()
        for p in self.procs:
            p.join(10)


class Interleaved:
    """The hand-off's ceilings, measured between its rounds (`handoff(between=...)`) so that both
    sides see the same phase of a noisy VM: after every NIXL hand-off, one raw round and one verified
    raw round (`RawPairs`) over the pairs the hand-off used, each carrying the bytes it
    carried, in alternating order. The instances stay up, idle, meanwhile; their CPU over the raw
    rounds is recorded (it competes with the raw side, never with the hand-off)."""

    def __init__(self):
        self.raw: RawPairs | None = None
        self.pair_bytes: dict = {}
        self.times: dict[str, list[float]] = {"raw": [], "verified": []}
        self.idle_cpu_s, self.rounds = 0.0, 0

    def __call__(self, pair_bytes: dict, row_bytes: int, pids: list[int]) -> None:
        if self.raw is None:
            self.raw, self.pair_bytes = RawPairs(pair_bytes, row_bytes), dict(pair_bytes)
        if pair_bytes != self.pair_bytes:
            raise RuntimeError(f"the hand-off's pairs changed: {pair_bytes} vs {self.pair_bytes}")
        c0 = [cpu_seconds(pid) for pid in pids]
        order = ("raw", "verified") if self.rounds % 2 == 0 else ("verified", "raw")
        for kind in order:
            self.times[kind].append(self.raw.round(kind == "verified"))
        self.idle_cpu_s += sum(cpu_seconds(pid) - c for pid, c in zip(pids, c0))
        self.rounds += 1

    def result(self, kind: str) -> dict:
        times, nbytes = self.times[kind], self.raw.nbytes
        med = statistics.median(times)
        return {
            "pairs": len(self.pair_bytes),
            "pair_bytes": {f"{s} -> {d}": n for (s, d), n in sorted(self.pair_bytes.items())},
            "bytes": nbytes,
            "seconds": {"min": min(times), "median": med, "max": max(times), "all": times},
            "GBps_median": nbytes / med / 1e9,
        }

    def instances_cpu_ms(self) -> float:
        """The idle instances' CPU per pair of raw rounds (ms, all their rank processes)."""
        return round(1000 * self.idle_cpu_s / max(self.rounds, 1), 1)

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
