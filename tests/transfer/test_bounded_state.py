"""Bounded state on the decode side (docs/design.md invariant 7 and 11, issue 13 item 4): requests naming
ENDPOINTS distinct bogus bootstrap endpoints (nothing answers there) go through DecodeRooms (the decode
server's hand-off rooms) with a real decode instance; each fails cleanly, and the process's threads (OS threads: ZMQ's are not
Python threads) and file descriptors stay within a bound -- side-channel clients share one ZMQ
context, are cached per peer with an LRU bound and closed when idle. The decode loop thread's health
check of the ranks' receiver threads reports them alive."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pdserve.decode_server.destination import DriverDestination
from pdserve.decode_server.handoff_rooms import DecodeRooms
from pdserve.request import SamplingParams
from pdserve.serving.instance_loop import Failed

pytestmark = pytest.mark.slow

ENDPOINTS, BATCH, MAX_CLIENTS = 2000, 10, 16


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_batch(remote: DecodeRooms, decode, ports: range, events: list) -> None:
    for port in ports:
        remote.submit(f"bogus-{port}", 1, SamplingParams(max_tokens=1), f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    while remote.pending:
        assert time.monotonic() < deadline, f"{len(remote.rooms)} rooms still pending"
        decode.admit()
        remote.poll()


def test_thousands_of_bogus_bootstrap_endpoints_keep_threads_and_fds_bounded(instances):
    decode = instances.get_decode(1, 1, "copy")
    events: list = []
    remote = DecodeRooms(
        DriverDestination(decode),
        lambda room, event: events.append((room, event)),
        heartbeat_timeout_s=0.001,
        max_clients=MAX_CLIENTS,
        client_idle_s=0.2,
    )
    try:
        run_batch(remote, decode, range(1, 1 + BATCH), events)  # warm: the shared context's threads exist
        base_threads, base_py, base_fds = os_threads(), threading.active_count(), fds()
        peak_threads = peak_fds = 0
        for start in range(1 + BATCH, 1 + ENDPOINTS, BATCH):
            run_batch(remote, decode, range(start, min(start + BATCH, 1 + ENDPOINTS)), events)
            peak_threads, peak_fds = max(peak_threads, os_threads()), max(peak_fds, fds())
            assert len(remote.clients) <= MAX_CLIENTS
        assert peak_threads - base_threads <= 2 and threading.active_count() <= base_py + 1
        assert peak_fds - base_fds <= 4 * MAX_CLIENTS, (base_fds, peak_fds)
        assert len(events) == ENDPOINTS and all(
            isinstance(ev, Failed) and "stopped answering" in ev.message for _, ev in events
        )
        assert remote.clients_closed >= ENDPOINTS - MAX_CLIENTS
        time.sleep(0.3)
        remote._next_check = 0.0  # the next poll runs the periodic housekeeping now
        remote.poll()
        assert not remote.clients  # idle ones are closed
        assert remote.unhealthy() is None  # every rank's receiver thread lives
        alloc = decode.instance.allocator
        assert decode.scheduler.is_idle() and alloc.num_free == alloc.num_pages
        assert all(s.counters["open_rooms"] == 0 for s in decode.instance.transfer_status("none"))
    finally:
        remote.close()
