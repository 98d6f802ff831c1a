"""Free TCP ports for the processes this one starts (`pdserve up`'s instances, the tests' and
benches' servers). Torch-free.

A port from bind(0) lies in the kernel's ephemeral range, which every outgoing connection and every
other bind(0) (gloo, UCX) also draws from: between choosing it and the child binding it seconds
later, another socket can take it, and the child fails with "address already in use". So ports are
drawn at random below that range, where the kernel never assigns one by itself, checked free, and
never handed out twice by this process.
"""

from __future__ import annotations

import random
import socket

LOW_PORT = 10000  # above the registered services most machines run
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_given: set[int] = set()
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, outside the ephemeral range, not returned before by this process.
    Falls back to bind(0) when the range leaves no room below it or no try finds one free."""
    low, _ = ephemeral_range()
    for _ in range(200 if low - LOW_PORT >= 1000 else 0):
        port = _rng.randrange(LOW_PORT, low)
        if port not in _given and _bindable(host, port):
            _given.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
