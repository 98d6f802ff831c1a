"""One launcher for the rank processes of an instance.

`RankGroup` starts `world_size` processes; each selects its GPU when on cuda, joins a
torch.distributed process group (gloo on CPU and for ranks sharing a GPU, NCCL beside gloo for one
GPU per rank; engine/device.py) on the configured port, sets its torch thread count, builds its
worker and acks readiness. The launcher then sends every rank the same command and gathers one reply per rank.
It owns shutdown: `shutdown()` stops every rank, and `dead_rank()` reports a rank that died, so
the instance can stop at once with a message naming it instead of hanging in a collective.
Each rank asks the kernel to SIGTERM it when the launcher dies, so no rank is ever orphaned.

How ranks start (`_start_context`): on cpu they fork from multiprocessing's forkserver, a clean
process that imported torch once per launcher, so a group of W ranks costs one torch import
instead of W, and later groups none; a server starts it (`prestart`) before it imports torch
itself, so the two imports overlap. Each rank takes the launcher's environment as it is at its
group's start; only what torch reads while it loads comes from the forkserver's start. A rank
closes its copy of the forkserver's "alive" pipe, so the forkserver exits when the launcher dies
and the rank's death signal fires as before. On cuda ranks are spawned, fresh interpreters, as
CUDA wants.

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
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

from .parent_death import die_with_parent

_STOP = "__stop__"
_LISTENERS: list = []  # rank 0's rendezvous socket (see _store)


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
    device: str = "cpu"  # "cuda": rank r on GPU gpu_ids[r] (engine/device.py)
    gpu_ids: tuple[int, ...] = ()  # default: rank r uses GPU r
    ready_timeout_s: float = 600.0
    collective_timeout_s: float = 600.0
    error_grace_s: float = 30.0  # after one rank failed a command, how long the others may take to finish it

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 < self.dist_port < 65536:
            raise ValueError(f"dist_port must be a TCP port, got {self.dist_port}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        object.__setattr__(self, "gpu_ids", tuple(self.gpu_ids))
        self.devices()  # a configuration that cannot run fails here, before any rank starts

    @classmethod
    def of_server(cls, cfg, world_size: int) -> "LaunchConfig":
        """The ranks of a prefill or decode server config (its dist port, threads, device, GPUs)."""
        return cls(
            world_size,
            cfg.dist_port,
            threads_per_rank=cfg.threads_per_rank,
            device=cfg.device,
            gpu_ids=cfg.gpu_ids,
        )

    def devices(self, cuda_count: int | None = None):
        """The DevicePlan (engine/device.py): each rank's GPU, the process-group backend, the comm."""
        from .device import check_devices

        return check_devices(self.device, self.world_size, self.gpu_ids, cuda_count)


# what the forkserver imports once for every cpu rank; symbolic_shapes (and sympy under it) is what
# Module.to_empty imports on first use: about 1 s of each rank's start when left to the rank
_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes"]


def _start_context(device: str):
    """The multiprocessing context ranks start from (see the module doc)."""
    if device != "cpu":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def prestart(device: str) -> bool:
    """Starts the forkserver that cpu ranks fork from now, before the caller imports torch itself:
    its torch import then runs beside the caller's on another core instead of after it (a server
    process imports torch too, then starts its ranks). False, and nothing started, unless device is
    "cpu" (cuda ranks are spawned). Call it only once the environment the ranks' torch should load
    with is set (module doc)."""
    if device != "cpu":
        return False
    from multiprocessing import forkserver

    _start_context(device)
    forkserver.ensure_running()  # returns at once: the forkserver imports _PRELOAD on its own
    return True


def _leave_forkserver() -> None:
    """A forked rank holds the forkserver's "alive" pipe like its launcher does: closing it lets the
    forkserver exit when the launcher dies, which SIGTERMs the rank (die_with_parent)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:  # None in a spawned rank
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _rank_main(
    factory: Callable[..., Any],
    payload: Any,
    rank: int,
    cfg: LaunchConfig,
    conn: Connection,
    environ: dict[str, str],
) -> None:
    die_with_parent()
    _leave_forkserver()
    os.environ.clear()
    os.environ.update(environ)  # the launcher's, not the forkserver's (started with the first group)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads_per_rank)
    try:
        from .device import setup_rank_device

        plan = cfg.devices()
        setup_rank_device(plan, rank)  # before the process group: NCCL binds to the current GPU
        timeout = timedelta(seconds=cfg.collective_timeout_s)
        dist.init_process_group(
            plan.dist_backend,
            store=_store(rank, cfg, timeout),
            rank=rank,
            world_size=cfg.world_size,
            timeout=timeout,
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


def _store(rank: int, cfg: LaunchConfig, timeout: timedelta):
    """The rendezvous store, listening on dist_host only (torch's own would listen on every interface);
    gloo's connections too stay on loopback when dist_host is a loopback address."""
    import socket

    import torch.distributed as dist

    if cfg.dist_host in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if rank != 0:
        return dist.TCPStore(cfg.dist_host, cfg.dist_port, cfg.world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in cfg.dist_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((cfg.dist_host, cfg.dist_port))
    listener.listen(256)
    store = dist.TCPStore(
        cfg.dist_host,
        cfg.dist_port,
        cfg.world_size,
        True,
        timeout=timeout,
        master_listen_fd=listener.fileno(),
    )
    _LISTENERS.append(listener)  # the store serves on this socket: it must stay open as long as the process
    return store


class RankGroup:
    def __init__(self, factory: Callable[..., Any], payload: Any, cfg: LaunchConfig):
        self.factory, self.payload, self.cfg = factory, payload, cfg
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.infos: list[dict] = []
        self.broken: str | None = None  # set when the group can no longer run commands (see the module doc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self) -> list[dict]:
        """Starts the ranks and waits for every readiness ack; returns each rank's info."""
        ctx = _start_context(self.cfg.device)
        for rank in range(self.cfg.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                args=(self.factory, self.payload, rank, self.cfg, child, dict(os.environ)),
                name=f"pdserve-rank{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        try:
            self.infos, errors = self._gather(time.monotonic() + self.cfg.ready_timeout_s)
            if errors:
                rank = min(errors)
                raise RankError(f"rank {rank} failed to start:\n{errors[rank]}")
        except BaseException:
            self.shutdown()
            raise
        return self.infos

    def _last_words(self, dead: str, pending: set[int], errors: dict[int, str]) -> str:
        """Why the group broke: `dead`, and the traceback of the first rank that failed, if any. A rank
        that fails sends its traceback and then exits with code 0, so its message may still be
        unread in its pipe, or already read while its peers were still pending."""
        for rank in sorted(pending):
            try:
                if self.conns[rank].poll(0):
                    kind, value = self.conns[rank].recv()
                    if kind == "error":
                        errors[rank] = value
            except (EOFError, OSError):
                pass  # nothing left to read: the rank died without a word
        if not errors:
            return dead
        rank = min(errors)
        return f"{dead}; rank {rank} failed first:\n{errors[rank]}"

    def dead_rank(self) -> str | None:
        """A message naming the first rank that is no longer alive, or None."""
        for rank, p in enumerate(self.procs):
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
        if self.broken:
            raise RankError(f"the rank group is broken: {self.broken}")
        try:
            for conn in self.conns:
                try:
                    conn.send(cmd)
                except OSError:  # BrokenPipeError: that rank is gone
                    raise RankError(self.dead_rank() or "a rank closed its pipe") from None
            replies, errors = self._gather(time.monotonic() + (timeout_s or self.cfg.collective_timeout_s))
        except RankError as e:
            self.broken = str(e).splitlines()[0]
            raise
        if errors:
            rank = min(errors)
            raise CommandFailed(rank, errors[rank])
        return replies

    def _gather(self, deadline: float) -> tuple[list[Any], dict[int, str]]:
        """Every rank's reply (or its error's traceback), once each rank answered."""
        replies: list[Any] = [None] * len(self.conns)
        errors: dict[int, str] = {}
        pending = set(range(len(self.conns)))
        while pending:
            for rank in sorted(pending):
                conn = self.conns[rank]
                if conn.poll(0.05):
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):  # the rank died: its pipe closed or was reset
                        raise RankError(self.dead_rank() or f"rank {rank} closed its pipe") from None
                    if kind == "error":
                        errors[rank] = value
                        deadline = min(deadline, time.monotonic() + self.cfg.error_grace_s)
                    else:
                        replies[rank] = value
                    pending.discard(rank)
            dead = self.dead_rank()
            if dead and pending:
                raise RankError(self._last_words(dead, pending, errors))
            if pending and time.monotonic() > deadline:
                why = (
                    f" after rank {min(errors)} failed ({_last_line(errors[min(errors)])})" if errors else ""
                )
                raise RankError(f"ranks {sorted(pending)} did not finish the command{why}")
        return replies, errors

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
    runs the handler that commands() registers for the command's type (or, for a str, its value)."""

    @abstractmethod
    def commands(self) -> dict[Any, Callable[[Any], Any]]:
        """{command type (or str value): its handler} of this worker."""

    def handle(self, cmd):
        for kind, run in self.commands().items():
            if cmd == kind if isinstance(kind, str) else isinstance(cmd, kind):
                return run(cmd)
        raise TypeError(f"unknown command {type(cmd).__name__}")
