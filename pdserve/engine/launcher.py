"""One launcher for the rank processes of an instance.

`RankGroup` spawns `world_size` processes; each joins a torch.distributed process group (gloo on
CPU, NCCL on CUDA) on the configured port, sets its torch thread count, builds its worker and acks
readiness. The launcher then sends every rank the same command and gathers one reply per rank.
It owns shutdown: `shutdown()` stops every rank, and `dead_rank()` reports a rank that died, so
the instance can stop at once with a message naming it instead of hanging in a collective.
Each rank asks the kernel to SIGTERM it when the launcher dies, so no rank is ever orphaned.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

_STOP = "__stop__"


class RankError(RuntimeError):
    """A rank died or failed; the message names the rank."""


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    dist_port: int
    dist_host: str = "127.0.0.1"
    threads_per_rank: int = 1
    backend: str = "gloo"  # "nccl" on CUDA
    ready_timeout_s: float = 600.0
    collective_timeout_s: float = 600.0

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 < self.dist_port < 65536:
            raise ValueError(f"dist_port must be a TCP port, got {self.dist_port}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")


def _die_with_parent() -> None:
    try:  # Linux: PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _rank_main(factory: Callable[..., Any], payload: Any, rank: int, cfg: LaunchConfig, conn: Connection) -> None:
    _die_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads_per_rank)
    try:
        dist.init_process_group(
            cfg.backend, init_method=f"tcp://{cfg.dist_host}:{cfg.dist_port}", rank=rank,
            world_size=cfg.world_size, timeout=timedelta(seconds=cfg.collective_timeout_s),
        )
        worker = factory(rank, cfg.world_size, payload)
        conn.send(("ready", getattr(worker, "info", lambda: {})()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd = conn.recv()
        if cmd == _STOP:
            break
        try:
            conn.send(("ok", worker.handle(cmd)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class RankGroup:
    def __init__(self, factory: Callable[..., Any], payload: Any, cfg: LaunchConfig):
        self.factory, self.payload, self.cfg = factory, payload, cfg
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.infos: list[dict] = []
        self.broken: str | None = None  # set when a call failed: replies may be out of step, so no more calls

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> list[dict]:
        """Spawns the ranks and waits for every readiness ack; returns each rank's info."""
        ctx = mp.get_context("spawn")
        for rank in range(self.cfg.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(self.factory, self.payload, rank, self.cfg, child),
                            name=f"pdserve-rank{rank}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        try:
            self.infos = self._gather(time.monotonic() + self.cfg.ready_timeout_s, "ready")
        except BaseException:
            self.shutdown()
            raise
        return self.infos

    def dead_rank(self) -> str | None:
        """A message naming the first rank that is no longer alive, or None."""
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def call(self, cmd: Any, timeout_s: float | None = None) -> list[Any]:
        """Sends the same command to every rank and returns their replies in rank order.

        A failure breaks the group for good: the other ranks may still be inside a collective, and
        their late replies would answer the next command."""
        if self.broken:
            raise RankError(f"the rank group is broken: {self.broken}")
        for conn in self.conns:
            conn.send(cmd)
        try:
            return self._gather(time.monotonic() + (timeout_s or self.cfg.collective_timeout_s), "ok")
        except RankError as e:
            self.broken = str(e).splitlines()[0]
            raise

    def _gather(self, deadline: float, want: str) -> list[Any]:
        replies: list[Any] = [None] * len(self.conns)
        pending = set(range(len(self.conns)))
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn.poll(0.05):
                    try:
                        kind, value = conn.recv()
                    except EOFError:
                        raise RankError(self.dead_rank() or f"rank {rank} closed its pipe") from None
                    if kind == "error":
                        raise RankError(f"rank {rank} failed:\n{value}")
                    replies[rank] = value
                    pending.discard(rank)
            dead = self.dead_rank()
            if dead and pending:
                raise RankError(dead)
            if time.monotonic() > deadline:
                raise RankError(f"ranks {sorted(pending)} did not answer within the timeout")
        return replies

    def shutdown(self, grace_s: float = 5.0) -> None:
        for conn, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    conn.send(_STOP)
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(1.0)
        for conn in self.conns:
            conn.close()
