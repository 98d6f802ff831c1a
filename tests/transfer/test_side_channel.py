"""The side channel over real ZMQ sockets in one process: a reservation reaches the prefill's
ROUTER, the outcome goes back to the DEALER that reserved the room (not another), decode aborts
reach the prefill, a missing reservation is a bootstrap timeout, garbage frames are dropped -- for
the polled BootstrapServer and for BootstrapService (own thread). The service heartbeats every
decode peer with an open room, and only while the room is open."""

from __future__ import annotations

import time

import pytest

from pdserve.transfer.decode_client import DecodeClient
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.messages import DecodeReservation, Fingerprint, Heartbeat, TransferDone, TransferFailed
from pdserve.transfer.side_channel import (
    HEARTBEAT_S,
    BootstrapServer,
    BootstrapService,
    BootstrapTimeout,
)

FP = Fingerprint("h", "auto", "float64", 4, 4, 2, "copy")
TICKET = new_ticket()


def reservation(room: str) -> DecodeReservation:
    return DecodeReservation(
        room, FP, 1, 2, 2, 4, (1, 2), {0: "tcp://127.0.0.1:1", 1: "tcp://127.0.0.1:2"}, ticket=TICKET
    )


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.fixture(params=[BootstrapServer, BootstrapService])
def channel(request):
    server = request.param()
    a, b = DecodeClient(server.endpoint), DecodeClient(server.endpoint)
    assert a.wait_ready(5, server.drain) and b.wait_ready(5, server.drain)  # Hello / Welcome
    yield server, a, b
    for x in (a, b, server):
        x.close()


def test_reservation_and_outcome_go_to_the_right_peer(channel):
    server, a, b = channel
    a.send(reservation("ra"))
    b.send(reservation("rb"))
    a.send(Heartbeat("decode-a", 1, 0.0))
    assert server.wait_reservation("rb", 5) == reservation("rb")
    assert server.wait_reservation("ra", 5) == reservation("ra")
    server.reply(TransferDone("ra", 7, {0: 1}, FP))
    server.reply(TransferFailed("rb", "refused"))
    wait_for(lambda: a.outcome("ra") is not None and b.outcome("rb") is not None)
    stamped = TransferDone("ra", 7, {0: 1}, FP, reservation("ra").ticket)  # the reply carries its ticket
    assert a.outcome("ra") == stamped and a.outcome("rb") is None
    assert b.outcome("rb") == TransferFailed("rb", "refused", TICKET) and b.outcome("ra") is None
    # the heartbeat went after "ra" on a's connection: when "ra" was already in, nothing drained it yet
    wait_for(lambda: server.drain() or "decode-a" in server.heartbeats)
    assert not server.reservations and not server.peers


def test_decode_abort_reaches_the_prefill(channel):
    server, a, _ = channel
    a.send(reservation("r"))
    server.wait_reservation("r", 5)
    a.send(TransferFailed("r", "client went away"))
    wait_for(lambda: server.drain() or "r" in server.aborted)
    assert server.aborted["r"] == "client went away"
    server.forget("r")
    assert not (server.aborted or server.reservations or server.peers)


def test_bootstrap_timeout_and_garbage(channel):
    server, a, _ = channel
    a.sock.send(b"\x93not a message")
    with pytest.raises(BootstrapTimeout, match="room nobody"):
        server.wait_reservation("nobody", 0.2)
    assert server.unauthenticated == 1 and not server.reservations


def test_service_heartbeats_peers_with_open_rooms_only():
    server = BootstrapService()
    a, b, witness = (DecodeClient(server.endpoint) for _ in range(3))
    try:
        start = time.monotonic()
        a.send(reservation("r"))
        wait_for(lambda: a.drain() or server.endpoint in a.heartbeats)
        wait_for(
            lambda: a.drain() or a.heartbeats[server.endpoint] > start + 2 * HEARTBEAT_S
        )  # it keeps coming
        assert a.silent_for(server.endpoint, start) < 2 * HEARTBEAT_S
        server.reply(TransferDone("r", 7, {}, FP))  # the room is answered: no more heartbeats to a
        wait_for(lambda: a.outcome("r") is not None)
        answered = time.monotonic()
        witness.send(reservation("w"))  # its heartbeats show the service's rounds go on
        wait_for(
            lambda: witness.drain() or witness.heartbeats.get(server.endpoint, 0) > answered + 2 * HEARTBEAT_S
        )
        a.drain()
        assert a.silent_for(server.endpoint, start) > 2 * HEARTBEAT_S
        b.drain()
        assert server.endpoint not in b.heartbeats  # b never reserved anything here
    finally:
        for x in (a, b, witness, server):
            x.close()
