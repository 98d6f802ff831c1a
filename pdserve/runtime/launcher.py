"""One launcher for the rank processes of an instance.

`RankGroup` starts `world_size` processes; each selects its GPU when on cuda, joins a
torch.distributed process group (gloo on CPU and for ranks sharing a GPU, NCCL beside gloo for one
GPU per rank; runtime/device.py) on the configured port, sets its torch thread count, builds its
worker and acks readiness. The launcher then sends every rank the same command and gathers one reply per rank.
It owns shutdown: `shutdown()` stops every rank, and `dead_rank()` reports a rank that died, so
the instance can stop at once with a message naming it instead of hanging in a collective.
Each rank asks the kernel to SIGTERM it when the launcher dies, so no rank is ever orphaned.

How ranks start and what runs in them: runtime/rank_process.py. An instance over several hosts
(`nnodes` > 1) runs the ranks of node 0 here and those of every other node in that node's agent;
`node_group.make_group` then returns the leader's group, which drives both with the
same commands and the same semantics.

Failure isolation (docs/design.md invariant 9): an exception inside a command (a bad request, an
unexpected shape, an injected fault) is that command's failure, `CommandFailed`, and the group
stays usable, provided every rank answered: a rank answers only once it is out of its command, so
no collective can be left half-done. Only a rank that dies, or ranks that stay inside the command
`error_grace_s` after a peer failed (stuck in a collective the failed rank never joined), break the
group for good (`RankError`; `unhealthy()` then names the reason).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from .faults import ArmFaultCmd, arm_command
from .placement import check_gpu_ids
from .rank_process import STOP, prestart, rank_main, start_context

__all__ = ["CommandFailed", "LaunchConfig", "RankError", "RankGroup", "RankWorker", "prestart"]


class RankError(RuntimeError):
    """A rank died, or the group can no longer be trusted; the message names the rank."""


class CommandFailed(RuntimeError):
    """One command failed on some rank while every rank answered: the group is still usable.

    The message is the failing rank and the exception's last line; `traceback` holds the whole of it
    (for logs, never for clients)."""

    def __init__(self, rank: int, traceback_text: str):
        super().__init__(f"rank {rank}: {_last_line(traceback_text)}")
        self.rank, self.traceback = rank, traceback_text


@dataclass(frozen=True)
class LaunchConfig:
    world_size: int
    dist_port: int
    dist_host: str = "127.0.0.1"
    threads_per_rank: int = 1
    device: str = "cpu"  # "cuda": rank r on GPU gpu_ids[r] (runtime/device.py)
    gpu_ids: tuple[int, ...] = ()  # default: rank r uses GPU r
    ready_timeout_s: float = 600.0
    collective_timeout_s: float = 600.0
    error_grace_s: float = 30.0  # after one rank failed a command, how long the others may take to finish it
    nnodes: int = 1  # hosts the ranks are split over (runtime/node_group.py); world_size / nnodes on each
    node_rank: int = 0  # this host's: it runs global ranks node_rank x ranks_per_node + 0, 1, ...
    node_timeout_s: float = 10.0  # a node agent (or the leader) silent this long is dead

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide the instance's {self.world_size} ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if not 0 < self.dist_port < 65536:
            raise ValueError(f"dist_port must be a TCP port, got {self.dist_port}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        check_gpu_ids(self.gpu_ids)
        self.devices()  # a configuration that cannot run fails here, before any rank starts

    @classmethod
    def of_server(cls, cfg, world_size: int) -> "LaunchConfig":
        """The ranks of a prefill or decode server config (its rendezvous address, threads, device,
        GPUs, nodes)."""
        host, port = cfg.dist_endpoint()
        return cls(
            world_size,
            port,
            dist_host=host,
            threads_per_rank=cfg.threads_per_rank,
            device=cfg.device,
            gpu_ids=cfg.gpu_ids,
            nnodes=cfg.nnodes,
            node_rank=cfg.node_rank,
            node_timeout_s=cfg.node_timeout_s,
        )

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> list[int]:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    def devices(self, cuda_count: int | None = None):
        """The DevicePlan (runtime/device.py) of one node: each local rank's GPU, the process-group
        backend, the comm."""
        from .device import check_devices

        return check_devices(self.device, self.ranks_per_node, self.gpu_ids, cuda_count, self.nnodes)


def raise_start_errors(errors: dict[int, str]) -> None:
    """RankError naming the lowest rank that failed to start (errors: rank -> its traceback)."""
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} failed to start:\n{errors[rank]}")


class RankGroup:
    """The ranks of this node (all of them for a one-host instance), each driven over a pipe."""

    def __init__(self, factory: Callable[..., Any], payload: Any, cfg: LaunchConfig):
        self.factory, self.payload, self.cfg = factory, payload, cfg
        self.rank_ids: list[int] = cfg.local_ranks  # global rank of each process, in order
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.infos: list[dict] = []
        self.broken: str | None = None  # set when the group can no longer run commands (see the module doc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> list[dict]:
        """Starts the ranks and waits for every readiness ack; returns each rank's info."""
        self._spawn()
        try:
            self.infos, errors = self._gather(time.monotonic() + self.cfg.ready_timeout_s)
            raise_start_errors(errors)
        except BaseException:
            self.shutdown()
            raise
        return self.infos

    def _spawn(self) -> None:
        ctx = start_context(self.cfg.device)
        for rank in self.rank_ids:
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=rank_main,
                args=(self.factory, self.payload, rank, self.cfg, child, dict(os.environ)),
                name=f"pdserve-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def _last_words(self, dead: str, pending: set[int], errors: dict[int, str]) -> str:
        """Why the group broke: `dead`, and the traceback of the first rank that failed, if any. A rank
        that fails sends its traceback and then exits with code 0, so its message may still be
        unread in its pipe, or already read while its peers were still pending."""
        for i in sorted(pending):
            try:
                if self.conns[i].poll(0):
                    kind, value = self.conns[i].recv()
                    if kind == "error":
                        errors[self.rank_ids[i]] = value
            except (EOFError, OSError):
                pass  # nothing left to read: the rank died without a word
        if not errors:
            return dead
        rank = min(errors)
        return f"{dead}; rank {rank} failed first:\n{errors[rank]}"

    def dead_rank(self) -> str | None:
        """A message naming the first rank that is no longer alive, or None."""
        for rank, p in zip(self.rank_ids, self.procs):
            if not p.is_alive():
                return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def unhealthy(self) -> str | None:
        """Why the group cannot serve (a dead rank, or broken), or None."""
        return self.dead_rank() or (f"the rank group is broken: {self.broken}" if self.broken else None)

    def call(self, cmd: Any, timeout_s: float | None = None) -> list[Any]:
        """Sends the same command to every rank and returns their replies in rank order.

        Raises CommandFailed when a rank raised but every rank answered (the group stays usable), and
        RankError when the group broke: a rank died or the ranks did not all get out of the command,
        so late replies would answer the next command."""
        replies, errors = self.call_raw(cmd, timeout_s)
        if errors:
            rank = min(errors)
            raise CommandFailed(rank, errors[rank])
        return replies

    def call_raw(self, cmd: Any, timeout_s: float | None = None) -> tuple[list[Any], dict[int, str]]:
        """call() without raising CommandFailed: (replies, {global rank: traceback} of the ranks that raised)."""
        if self.broken:
            raise RankError(f"the rank group is broken: {self.broken}")
        try:
            self._send_all(cmd)
            return self._gather(time.monotonic() + (timeout_s or self.cfg.collective_timeout_s))
        except RankError as e:
            self.broken = str(e).splitlines()[0]
            raise

    def _send_all(self, cmd: Any) -> None:
        for conn in self.conns:
            try:
                conn.send(cmd)
            except OSError:  # BrokenPipeError: that rank is gone
                raise RankError(self.dead_rank() or "a rank closed its pipe") from None

    def _gather(self, deadline: float) -> tuple[list[Any], dict[int, str]]:
        """Every rank's reply (or its error's traceback), once each rank answered."""
        replies: list[Any] = [None] * len(self.conns)
        errors: dict[int, str] = {}
        pending = set(range(len(self.conns)))
        while pending:
            for i in sorted(pending):
                if self.conns[i].poll(0.05):
                    deadline = self._take_local(i, replies, errors, deadline)
                    pending.discard(i)
            self._check(pending, errors, deadline)
        return replies, errors

    def _take_local(self, i: int, replies: list, errors: dict, deadline: float) -> float:
        """Reads local rank i's answer (its pipe is readable); returns the deadline, cut to
        error_grace_s after a rank failed."""
        try:
            kind, value = self.conns[i].recv()
        except (EOFError, OSError):  # the rank died: its pipe closed or was reset
            raise RankError(self.dead_rank() or f"rank {self.rank_ids[i]} closed its pipe") from None
        if kind == "error":
            errors[self.rank_ids[i]] = value
            return min(deadline, time.monotonic() + self.cfg.error_grace_s)
        replies[i] = value
        return deadline

    def _check(self, pending: set, errors: dict[int, str], deadline: float) -> None:
        """RankError when a rank died while some are pending, or the deadline passed."""
        dead = self.dead_rank()
        if dead and pending:
            raise RankError(self._last_words(dead, {i for i in pending if isinstance(i, int)}, errors))
        if pending and time.monotonic() > deadline:
            why = f" after rank {min(errors)} failed ({_last_line(errors[min(errors)])})" if errors else ""
            raise RankError(f"ranks {self._pending_names(pending)} did not finish the command{why}")

    def _pending_names(self, pending: set) -> list:
        return sorted(self.rank_ids[i] for i in pending)

    def shutdown(self, grace_s: float = 5.0) -> None:
        for conn, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    conn.send(STOP)
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


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "unknown error"


class RankInstance:
    """What a prefill and a decode instance share: their RankGroup (`self.ranks`) starts with the
    instance, which is also a context manager; `rank_infos` holds each rank's readiness info."""

    ranks: RankGroup
    rank_infos: list

    def start(self):
        self.rank_infos = self.ranks.start()
        return self

    def shutdown(self) -> None:
        self.ranks.shutdown()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


class RankWorker(ABC):
    """What runs in a rank process (built by `factory(rank, world_size, payload)`): handle(cmd)
    runs the handler that commands() registers for the command's type (every command is a frozen
    dataclass next to its worker; anything else is an unknown command)."""

    @abstractmethod
    def commands(self) -> dict[Any, Callable[[Any], Any]]:
        """{command type (or a tuple of them): its handler} of this worker."""

    def handle(self, cmd):
        if isinstance(cmd, ArmFaultCmd):  # test-only, refused unless enabled (runtime/faults.py)
            return arm_command(cmd)
        for kind, run in self.commands().items():
            if isinstance(cmd, kind):
                return run(cmd)
        raise TypeError(f"unknown command {type(cmd).__name__}")
