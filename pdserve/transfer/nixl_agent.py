"""NIXL building blocks of the KV hand-off (transfer/nixl.py): agents, the endpoint a decode rank
hands out for one room, and the arena its receive regions are carved from."""

from __future__ import annotations

import base64
import os
import secrets
import socket
from dataclasses import dataclass

import msgpack

ALIGN = 64  # region starts: any dtype view of a chunk is aligned


def make_agent(name: str):
    """A NIXL agent with the UCX backend and no progress thread (its owner polls)."""
    # loopback like the TCP path; multi-node deployments set it
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl._api as api  # the meta package `nixl`
    except ImportError:
        import nixl_cu13._api as api  # `nixl-cu13` alone (pyproject pins it)
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def mem_type(t) -> str:
    """NIXL's memory type of a tensor: "VRAM" for a CUDA tensor (registered with its GPU ordinal as
    the device id), "DRAM" for host memory."""
    return "VRAM" if t.is_cuda else "DRAM"


def bind_device(t) -> None:
    """A thread that drives NIXL progress on VRAM must have the tensor's GPU as its current device."""
    if t.is_cuda:
        import torch

        torch.cuda.set_device(t.device)


def agent_name(role: str, rank: int) -> str:
    """Unique per process and rank: a restarted process gets a new name. Host name and pid alone
    are not unique: processes in PID namespaces of their own (containers, one per instance) share
    pids, and host-network containers share the host name; the random part keeps two instances'
    agents apart in a peer's cache."""
    return f"pdserve-{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}-r{rank}"


@dataclass(frozen=True)
class NixlEndpoint:
    """Where one sender writes one room on one decode rank."""

    agent: str
    generation: int
    metadata: bytes
    addr: int  # the room's region in the decode rank's registered arena (unused with `pool`)
    size: int
    # WRITEs land in the decode pool itself: [kv address, rows per layer, row bytes, [[layer, row], ...],
    # then the same for index keys] (NixlReceiver direct mode); None: they land in the region.
    pool: list | None = None
    mem: str = "DRAM"  # the decode rank's memory type ("VRAM" when its pool and arena are on a GPU)
    dev: int = 0  # its GPU ordinal with VRAM (NIXL descriptors name it)

    def encode(self) -> str:
        fields = [
            self.agent,
            self.generation,
            self.metadata,
            self.addr,
            self.size,
            self.pool,
            self.mem,
            self.dev,
        ]
        return "nixl:" + base64.b64encode(msgpack.packb(fields, use_bin_type=True)).decode()

    @classmethod
    def decode(cls, text: str) -> "NixlEndpoint":
        if not text.startswith("nixl:"):
            raise ValueError(f"not a nixl endpoint: {text[:16]!r}...")
        return cls(*msgpack.unpackb(base64.b64decode(text[5:]), raw=False, strict_map_key=False))


class Arena:
    """First-fit byte ranges of one buffer; released ranges merge with their free neighbours."""

    def __init__(self, size: int):
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]  # (start, length), sorted by start

    @property
    def used(self) -> int:
        return self.size - sum(n for _, n in self.free)

    def alloc(self, nbytes: int) -> tuple[int, int] | None:
        """(start, length) of an aligned range of at least nbytes (at least ALIGN), or None when full."""
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                self.free[i : i + 1] = [(start + n, length - n)] if length > n else []
                return start, n
        return None

    def release(self, start: int, n: int) -> None:
        merged = sorted(self.free + [(start, n)])
        self.free = [merged[0]]
        for s, length in merged[1:]:
            last_s, last_n = self.free[-1]
            if last_s + last_n == s:
                self.free[-1] = (last_s, last_n + length)
            else:
                self.free.append((s, length))
