"""What runs in a rank process, and how it is started (runtime/launcher.py owns the group).

How ranks start (`start_context`): on cpu they fork from multiprocessing's forkserver, a clean
process that imported torch once per launcher, so a group of W ranks costs one torch import
instead of W, and later groups none; a server starts it (`prestart`) before it imports torch
itself, so the two imports overlap. Each rank takes the launcher's environment as it is at its
group's start; only what torch reads while it loads comes from the forkserver's start. A rank
closes its copy of the forkserver's "alive" pipe, so the forkserver exits when the launcher dies
and the rank's death signal fires as before. On cuda ranks are spawned, fresh interpreters, as
CUDA wants.

A rank of a multi-node instance (runtime/node_group.py) is started the same way by its node's
launcher (the leader or a node agent); its number is global (node_rank x ranks per node + local
rank), its GPU is its local rank's, and it joins the one process group of the instance at
--dist-addr, where global rank 0 (on node 0) serves the rendezvous store.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Callable

from .parent_death import die_with_parent

STOP = "__stop__"
_LISTENERS: list = []  # rank 0's rendezvous socket (see _store)
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# what the forkserver imports once for every cpu rank. Nothing a rank runs at its start may import
# torch's Python meta references: model/shard.py builds and materializes meta models with C++ ops
# only (torch.fx's symbolic shapes and sympy, or torch._dynamo, cost 0.3-1 s of CPU each first time)
_PRELOAD = ["torch", "torch.distributed"]


def start_context(device: str):
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

    start_context(device)
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


def rank_main(
    factory: Callable[..., Any],
    payload: Any,
    rank: int,
    cfg,
    conn: Connection,
    environ: dict[str, str],
) -> None:
    """A rank process: device, process group, worker, readiness ack, then one reply per command.
    cfg: the instance's LaunchConfig (runtime/launcher.py); rank: the global rank."""
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
        setup_rank_device(plan, rank % cfg.ranks_per_node)  # before the group: NCCL binds to the current GPU
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
        if cmd == STOP:
            break
        try:
            conn.send(("ok", worker.handle(cmd)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def _store(rank: int, cfg, timeout: timedelta):
    """The rendezvous store, listening on dist_host only (torch's own would listen on every interface);
    gloo's connections too stay on loopback when dist_host is a loopback address."""
    import socket

    import torch.distributed as dist

    if cfg.dist_host in LOOPBACK and "GLOO_SOCKET_IFNAME" not in os.environ:
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
