"""Side-channel authentication over real ZMQ sockets (docs/design.md invariant 11, issue 13 item 2): a
peer without the cluster key (no tag, a wrong key) cannot reserve a room, replace a reservation or
abort a room -- its frames are dropped and counted; among peers with the key the first reservation
of a room wins and only the reserving peer can abort it; a decode client sends its reservation
(endpoints, NIXL agent metadata) only to a peer that proved it holds the key; reservations nobody
claims expire; a dead side-channel thread is reported for /health."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from pdserve.decode_server.handoff_rooms import DecodeRooms
from pdserve.serving.auth import frame_key, sign
from pdserve.transfer.decode_client import DecodeClient
from pdserve.transfer.frames import D2P, P2D, SIDE_MAX_BYTES, new_ticket
from pdserve.transfer.messages import (
    DecodeReservation,
    Fingerprint,
    Hello,
    TransferDone,
    TransferFailed,
    Welcome,
    decode,
    encode,
)
from pdserve.transfer.side_channel import BootstrapServer, BootstrapService

KEY, WRONG = (
    frame_key("the-cluster-token-for-these-tests-0123"),
    frame_key("another-clusters-token-0123456789"),
)
FP = Fingerprint("h", "auto", "float64", 4, 4, 1, "copy")


def reservation(room: str, endpoint: str = "tcp://127.0.0.1:1") -> DecodeReservation:
    return DecodeReservation(room, FP, 1, 1, 1, 4, (1, 2), {0: endpoint}, new_ticket())


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def raw_dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


@pytest.fixture()
def service():
    server = BootstrapService(key=KEY)
    ctx = zmq.Context()
    owner = DecodeClient(server.endpoint, KEY)
    other = DecodeClient(server.endpoint, KEY)  # holds the key, but did not reserve the room
    assert owner.wait_ready(5) and other.wait_ready(5)
    yield server, owner, other, ctx
    for c in (owner, other, server):
        c.close()
    ctx.destroy(linger=0)


def test_foreign_peers_cannot_reserve_replace_or_abort(service):
    server, owner, other, ctx = service
    foreign = raw_dealer(ctx, server.endpoint)
    first = reservation("r")
    foreign.send(encode(reservation("x")))  # no tag at all
    foreign.send_multipart(
        [encode(reservation("x")), sign(WRONG, D2P, encode(reservation("x")))]
    )  # wrong key
    frame = encode(reservation("x"))
    foreign.send_multipart([frame, sign(KEY, P2D, frame)])  # right key, wrong direction: a reflected frame
    wait_for(lambda: server.unauthenticated >= 3)
    assert not server.reservations
    owner.send(first)
    wait_for(lambda: "r" in server.reservations)
    for msg in (reservation("r"), TransferFailed("r", "foreign abort")):
        f = encode(msg)
        foreign.send_multipart([f, sign(WRONG, D2P, f)])
    wait_for(lambda: server.unauthenticated >= 5)
    other.send(reservation("r"))  # a peer with the key: the first reservation still wins
    other.send(TransferFailed("r", "not yours"))  # ... and it cannot abort another peer's room
    wait_for(lambda: server.refused >= 2)
    assert server.reservations["r"] == first and not server.aborted
    owner.send(TransferFailed("r", "client went away"))
    wait_for(lambda: "r" in server.aborted)
    assert (
        server.aborted["r"] == "client went away" and server.unauthenticated == 5 and server.bad_frames == 0
    )
    foreign.close()


def test_a_foreign_client_gets_no_welcome_and_sends_nothing(service):
    server, _, _, _ = service
    foreign = DecodeClient(server.endpoint, WRONG)
    try:
        foreign.send(reservation("never"))
        assert not foreign.wait_ready(0.3)
        assert server.unauthenticated >= 1 and not server.reservations
    finally:
        foreign.close()


def test_reservation_metadata_goes_only_to_a_peer_that_proved_the_key():
    """A fake prefill (a bare ROUTER) answers the Hello with a Welcome under the wrong key: the
    client holds its reservation (whose endpoints would carry NIXL agent metadata); once a Welcome
    under the right key comes, the reservation follows."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    client = DecodeClient(endpoint, KEY)
    try:
        assert router.poll(5000)
        identity, frame, _ = router.recv_multipart()
        hello = decode(frame)
        assert isinstance(hello, Hello)
        client.send(reservation("secret", "nixl:agent-metadata"))
        welcome = encode(Welcome(hello.nonce))
        router.send_multipart([identity, welcome, sign(WRONG, P2D, welcome)])
        assert not client.wait_ready(0.3) and client.unauthenticated == 1
        assert not router.poll(200)  # nothing but the Hello ever came
        router.send_multipart([identity, welcome, sign(KEY, P2D, welcome)])
        assert client.wait_ready(5)
        assert router.poll(5000)
        _, frame, _ = router.recv_multipart()
        assert decode(frame).room == "secret"
    finally:
        client.close()
        ctx.destroy(linger=0)


def test_the_proof_lasts_one_connection():
    """The proven prefill goes away and a listener without the key takes its port: the client's
    next reservation reaches nobody (it does not reconnect), and the client that replaces it
    (DecodeRooms, when the connection closed) says Hello again and holds its reservation until a
    Welcome under the key comes -- which the new listener cannot give."""
    server = BootstrapServer(key=KEY)
    endpoint = server.endpoint
    client = DecodeClient(endpoint, KEY)
    ctx = zmq.Context()
    rooms = DecodeRooms(dest=None, emit=lambda *_: None, frame_key=KEY)
    try:
        assert client.wait_ready(5, pump=server.drain)
        server.close()
        wait_for(lambda: client.drain() or client.dead)
        taker = ctx.socket(zmq.ROUTER)
        taker.setsockopt(zmq.LINGER, 0)
        taker.bind(endpoint)  # the same address, without the key
        client.send(reservation("secret", "nixl:agent-metadata"))
        assert not taker.poll(500)  # a reconnecting DEALER would have sent it here
        rooms.clients[endpoint] = client
        time.sleep(0.1)  # REPLACE_AFTER_S
        fresh = rooms._client(endpoint)
        assert fresh is not client and rooms.clients_replaced == 1 and not fresh.dead
        fresh.send(reservation("secret", "nixl:agent-metadata"))
        assert taker.poll(5000)
        _, frame, _ = taker.recv_multipart()
        assert isinstance(decode(frame), Hello)  # a new proof is asked for ...
        assert not fresh.wait_ready(0.3) and not taker.poll(200)  # ... and nothing else comes
        taker.close()
    finally:
        rooms.close()
        ctx.destroy(linger=0)


def test_outcomes_are_kept_only_for_the_clients_own_rooms(service):
    server, owner, other, _ = service
    owner.send(reservation("mine"))
    wait_for(lambda: "mine" in server.reservations)
    server.reply(TransferDone("mine", 3, {}, FP))
    wait_for(lambda: owner.outcome("mine") is not None)
    owner.forget("mine")
    assert not owner.outcomes and not other.outcomes


def test_unclaimed_reservations_expire_and_claimed_ones_stay():
    now = [0.0]
    server = BootstrapServer(key=KEY, reservation_ttl_s=0.2, clock=lambda: now[0])
    client = DecodeClient(server.endpoint, KEY)
    try:
        assert client.wait_ready(5, server.drain)
        client.send(reservation("idle"))
        client.send(reservation("served"))
        server.wait_reservation("idle", 5)
        server.wait_reservation("served", 5)
        assert server.claim("served") is not None
        now[0] += 0.19
        server.expire()
        assert server.expired == 0  # not yet
        now[0] += 0.02
        server.expire()
        assert "idle" not in server.reservations and server.expired == 1 and "served" in server.reservations
        server.reply(TransferFailed("served", "done with it"))
        assert not (server.reservations or server.peers or server.reserved_at or server.claimed)
    finally:
        client.close()
        server.close()


def test_a_dead_service_thread_is_reported():
    server = BootstrapService(key=KEY)
    try:
        assert server.unhealthy() is None
        server._stop.set()  # the thread leaves its loop, as if it had died
        server._thread.join(2)
        assert "dead" in server.unhealthy()
    finally:
        server.close()


def test_the_tag_covers_the_frame():
    """Flipping any byte of a signed frame, or moving it under another label, fails verification."""
    from pdserve.serving.auth import verify

    frame = msgpack.packb({"a": 1})
    tag = sign(KEY, D2P, frame)
    assert (
        verify(KEY, tag, D2P, frame)
        and not verify(KEY, tag, P2D, frame)
        and not verify(WRONG, tag, D2P, frame)
    )
    assert not any(
        verify(KEY, tag, D2P, frame[:i] + bytes([frame[i] ^ 1]) + frame[i + 1 :]) for i in range(len(frame))
    )


def test_oversized_frames_never_reach_the_decoder(service):
    """A correctly signed reservation larger than SIDE_MAX_BYTES: ZMQ's MAXMSGSIZE drops its
    connection before it is read; the service goes on serving."""
    server, owner, _, ctx = service
    big = encode(
        DecodeReservation("huge", FP, 1, 1, 1, 4, (1,), {r: "x" * (1 << 20) for r in range(5)}, new_ticket())
    )
    assert len(big) > SIDE_MAX_BYTES + 4096
    flood = raw_dealer(ctx, server.endpoint)
    flood.send_multipart([big, sign(KEY, D2P, big)])
    owner.send(reservation("after"))
    wait_for(lambda: "after" in server.reservations)
    time.sleep(0.2)
    assert "huge" not in server.reservations and server.unhealthy() is None
    assert server.sock.getsockopt(zmq.MAXMSGSIZE) == SIDE_MAX_BYTES + 4096
    flood.close()
