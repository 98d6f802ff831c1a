"""A junk-frame flood cannot wedge the prefill side channel (issue 40 item 2): while two DEALER
connections (a separate process, reconnecting now and then for fresh ZMQ identities) send junk
in a tight loop -- lone frames, oversized frames, and frames that look like a Hello with a wrong
tag (each costs the server an HMAC until its identity is muted) -- a keyed decode client that
connects gets its Welcome within 1 s, the client with an open room keeps getting heartbeats at
their period, and the scheduler's thread gets the room lock at once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.serving.auth import frame_key
from pdserve.transfer.decode_client import DecodeClient
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.messages import DecodeReservation, Fingerprint, Hello, encode
from pdserve.transfer.side_channel import HEARTBEAT_S, BootstrapService

KEY = frame_key("the-cluster-token-for-these-tests-0123")
FLOOD = r"""
import os, sys, zmq
endpoint, hello = sys.argv[1], bytes.fromhex(sys.argv[2])
ctx = zmq.Context()
def dealer():
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100000)
    s.connect(endpoint)
    return s
socks, i = [dealer(), dealer()], 0
while True:
    i += 1
    s = socks[i % 2]
    if i % 5000 == 0:
        s.close()
        socks[i % 2] = s = dealer()
    r = i % 4
    parts = ([os.urandom(16)] if r == 0 else [os.urandom(4096), os.urandom(32), b"x"] if r == 1
             else [hello, os.urandom(32)])
    s.send_multipart(parts)
"""


@pytest.fixture()
def flooded():
    server = BootstrapService(key=KEY)
    owner = DecodeClient(server.endpoint, KEY)
    assert owner.wait_ready(5)
    fp = Fingerprint("h", "auto", "float64", 4, 4, 1, "copy")
    owner.send(DecodeReservation("r", fp, 1, 1, 1, 4, (1, 2), {0: "tcp://127.0.0.1:1"}, new_ticket()))
    deadline = time.monotonic() + 5
    while "r" not in server.reservations:  # the room is open: heartbeats go to its client
        assert time.monotonic() < deadline
        owner.drain(5)
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, server.endpoint, encode(Hello(bytes(16))).hex()],
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 5
        while server.unauthenticated < 2000:  # the flood is in full swing
            assert time.monotonic() < deadline and flood.poll() is None, server.unauthenticated
            owner.drain(5)
        yield server, owner
    finally:
        flood.kill()
        flood.wait()
        owner.close()
        server.close()


def test_a_junk_flood_leaves_a_keyed_clients_welcome_under_1s_and_heartbeats_on_time(flooded):
    server, owner = flooded
    t0 = time.monotonic()
    newcomer = DecodeClient(server.endpoint, KEY)
    try:
        assert newcomer.wait_ready(1.0), "no Welcome within 1 s during the flood"
        welcome_s = time.monotonic() - t0
    finally:
        newcomer.close()
    t0 = time.monotonic()
    assert server.claim("r") is not None  # the scheduler's thread takes the lock
    assert time.monotonic() - t0 < 0.1
    beats, seen = [], owner.heartbeats.get(server.endpoint)
    end = time.monotonic() + 6 * HEARTBEAT_S
    while time.monotonic() < end:
        owner.drain(5)
        if owner.heartbeats.get(server.endpoint) != seen:
            seen = owner.heartbeats[server.endpoint]
            beats.append(seen)
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    assert len(beats) >= 4 and max(gaps) < 2 * HEARTBEAT_S, (welcome_s, gaps)
    assert server.unauthenticated + server.muted_frames > 2000 and server.mutes >= 1
