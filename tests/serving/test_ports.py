"""free_port hands out ports the kernel never gives an outgoing connection or a bind(0) meanwhile.

A port from bind(0) is in the ephemeral range, so between the choice and the child's bind seconds
later a gloo or UCX listener, or any client's connection, could take it (a prefill server failed
in CI with "address already in use"). serving/ports.py draws below that range instead.
"""

from __future__ import annotations

import socket

from pdserve.serving import ports


def test_ports_lie_below_the_ephemeral_range_free_and_distinct():
    low, high = ports.ephemeral_range()
    assert 0 < low <= high
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    for port in got:
        assert ports.LOW_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_a_port_in_use_or_given_before_is_skipped(monkeypatch):
    busy, given, free = ports.free_port(), ports.free_port(), ports.free_port()
    ports._given.discard(free)
    picks = iter([busy, given, free])
    monkeypatch.setattr(ports._rng, "randrange", lambda a, b: next(picks))
    with socket.socket() as held:
        held.bind(("127.0.0.1", busy))
        assert ports.free_port() == free
