"""Every listener survives any frame (docs/design.md invariant 11, issue 13 item 4). FRAMES random and
malformed frames -- most of them correctly signed, so they get past authentication into the
decoders -- go to each long-lived listener over its real transport: the prefill's side-channel
service (ZMQ DEALER -> ROUTER), a decode side-channel client (ROUTER -> DEALER), a TCP receiver
(PUSH -> PULL) and a NIXL notification receiver (a NIXL agent's notifications). Afterwards every
listener thread lives, none of its loop turns raised, and a normal exchange or hand-off is exact.
`messages.decode` itself is fuzzed first: it raises ProtocolError and nothing else."""

from __future__ import annotations

import random
import time

import msgpack
import torch
import zmq

from pdserve.serving.auth import frame_key, sign
from pdserve.transfer.decode_client import DecodeClient
from pdserve.transfer.frames import D2P, P2D, ListenerStatus, new_ticket, seal_data, seal_notif
from pdserve.transfer.messages import (
    DecodeReservation,
    Fingerprint,
    ProtocolError,
    TransferDone,
    Welcome,
    decode,
    encode,
)
from pdserve.transfer.nixl import NixlReceiver
from pdserve.transfer.nixl_agent import make_agent
from pdserve.transfer.nixl_send import NixlSender
from pdserve.transfer.plan import DecodeSide, PrefillSide, plan_transfer
from pdserve.transfer.rank_commands import (
    ExpectCmd,
    ForgetCmd,
    ListenerStatusCmd,
    SendCmd,
    StageCmd,
    TransferStatusCmd,
)
from pdserve.transfer.room_rows import RoomSlots
from pdserve.transfer.side_channel import BootstrapService
from pdserve.transfer.tcp import (
    TcpReceiver,
    TcpSender,
)
from tests.transfer import fuzz_frames as fz

FRAMES = 5000
KEY = frame_key("fuzz-cluster-token-0123456789abcdef")
FP = Fingerprint("h", "auto", "float64", 4, 4, 1, "copy")


def wait_for(cond, timeout_s=20.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def parts(rng: random.Random, body: bytes, label: bytes) -> list[bytes]:
    """[body, tag] mostly correctly signed; sometimes a bad tag, no tag, or extra parts."""
    r = rng.random()
    if r < 0.75:
        return [body, sign(KEY, label, body)]
    if r < 0.85:
        return [body, rng.randbytes(rng.choice([0, 31, 32, 33]))]
    return [body] if r < 0.93 else [body, sign(KEY, label, body), rng.randbytes(8)]


def test_decode_raises_only_protocol_errors():
    rng = random.Random(0)
    kinds = {}
    for _ in range(20_000):
        try:
            msg = decode(fz.body(rng, fz.side_message))
            kinds[type(msg).__name__] = kinds.get(type(msg).__name__, 0) + 1
            assert decode(encode(msg)) == msg  # whatever decodes is a well-formed message
        except ProtocolError:
            kinds["error"] = kinds.get("error", 0) + 1
    assert kinds["error"] > 10_000, kinds


def test_side_channel_service_survives_any_frame():
    server = BootstrapService(key=KEY)
    ctx = zmq.Context()
    fuzzer = ctx.socket(zmq.DEALER)
    fuzzer.setsockopt(zmq.LINGER, 0)
    fuzzer.connect(server.endpoint)
    rng = random.Random(1)
    try:
        for _ in range(FRAMES):
            fuzzer.send_multipart(parts(rng, fz.body(rng, fz.side_message), D2P))
        last = DecodeReservation("sentinel", FP, 1, 1, 1, 4, (1,), {0: "tcp://127.0.0.1:1"}, new_ticket())
        frame = encode(last)
        fuzzer.send_multipart([frame, sign(KEY, D2P, frame)])  # after every fuzz frame on this connection
        wait_for(lambda: "sentinel" in server.reservations, what="the service stopped taking frames")
        assert server.unhealthy() is None and server.live.crashes == 0
        # signed bodies that do not start as a message are screened out before their HMAC (counted
        # unauthenticated); the fuzzing connection sent authentic frames, so it is never muted
        assert server.unauthenticated > FRAMES // 10 and server.bad_frames > 0 and server.mutes == 0
        assert server.unauthenticated + server.bad_frames > FRAMES // 2
        client = DecodeClient(server.endpoint, KEY)  # a normal exchange
        try:
            assert client.wait_ready(5)
            mine = DecodeReservation("ok", FP, 1, 1, 1, 4, (2, 3), {0: "tcp://127.0.0.1:2"}, new_ticket())
            client.send(mine)
            wait_for(lambda: "ok" in server.reservations)
            assert server.reservations["ok"] == mine
            server.reply(TransferDone("ok", 5, {0: 9}, FP))
            wait_for(lambda: client.outcome("ok") is not None)
            assert client.outcome("ok") == TransferDone("ok", 5, {0: 9}, FP, mine.ticket)
        finally:
            client.close()
    finally:
        fuzzer.close()
        ctx.destroy(linger=0)
        server.close()


def outcome_like(rng: random.Random) -> dict:
    if rng.random() < 0.3:
        return {
            "__type__": "done",
            **fz.protocol_like(
                rng, {"room": "ok", "first_token": 1, "checksums": {}, "fingerprint": fz.obj(rng)}
            ),
        }
    return fz.side_message(rng)


def test_decode_client_survives_any_frame():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    client = DecodeClient(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}", KEY)
    rng = random.Random(2)
    try:
        assert router.poll(5000)
        identity, hello, _ = router.recv_multipart()
        client.send(DecodeReservation("ok", FP, 1, 1, 1, 4, (2,), {0: "tcp://127.0.0.1:2"}, new_ticket()))
        for i in range(FRAMES):
            router.send_multipart([identity, *parts(rng, fz.body(rng, outcome_like), P2D)])
            if i % 50 == 0:
                client.drain()  # raises nothing, whatever came
        welcome = encode(Welcome(decode(hello).nonce))
        router.send_multipart([identity, welcome, sign(KEY, P2D, welcome)])
        assert client.wait_ready(10)
        assert router.poll(5000) and decode(router.recv_multipart()[1]).room == "ok"  # the held reservation
        done = encode(TransferDone("ok", 7, {0: 1}, FP))
        router.send_multipart([identity, done, sign(KEY, P2D, done)])
        wait_for(lambda: client.outcome("ok") is not None)
        assert client.outcome("ok") == TransferDone("ok", 7, {0: 1}, FP)
        assert client.unauthenticated > FRAMES // 10 and client.bad_frames > FRAMES // 2
    finally:
        client.close()
        ctx.destroy(linger=0)


# ---- the data path -------------------------------------------------------------------------------------
def room_plan(cfg, pages=(2, 0, 1), n: int = 12):
    plan = plan_transfer(
        PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(20, 20 + n)),
        DecodeSide(1, 1, "copy", 4, pages),
        n,
    )
    rows: dict[str, int] = {}
    for t in plan:
        rows[t.kind] = rows.get(t.kind, 0) + t.rows
    return plan, {0: rows}, {0: {0: sum(rows.values())}}, RoomSlots.of(pages, 4, 1, "copy")


def header_like(rng: random.Random, room: str, ticket: bytes, width: int, notif: bool) -> dict:
    runs = [
        [rng.choice([0, 1, 8, 63, 64, 2**40, -1]), rng.choice([0, 1, 3, 2**40])]
        for _ in range(rng.randint(0, 3))
    ]
    common = {
        "room": room,
        "ticket": ticket,
        "src_rank": 0,
        "dtype": rng.choice(["torch.float64", "torch.int8"]),
    }
    if notif:
        fields = {
            **common,
            "offset": rng.choice([0, 8, 2**40]),
            "nbytes": rng.choice([0, 8 * width, 2**40]),
            "items": [[0, rng.choice(["kv", "index", "x"]), width, runs]],
        }
    else:
        fields = {
            **common,
            "layer": rng.choice([0, 1, 999]),
            "kind": rng.choice(["kv", "index", "x"]),
            "runs": runs,
            "width": rng.choice([width, 1]),
            "seq": 0,
        }
    return fz.protocol_like(rng, fields)


def check_delivery(recv, sender, room: str, pages, cfg, src, dst) -> None:
    """A normal hand-off of one room through recv: every row exact, the checksums agree."""
    plan, rows, expected, slots = room_plan(cfg, pages)
    ticket = new_ticket()
    endpoint = recv.handle(StageCmd(room, ticket, rows)).endpoint
    recv.handle(ExpectCmd(room, ticket, expected, slots))
    reply = sender.send(SendCmd(room, ticket, plan, {0: endpoint}))
    assert reply.error is None, reply
    wait_for(
        lambda: recv.handle(TransferStatusCmd(room)).room.complete,
        what=str(recv.handle(TransferStatusCmd(room))),
    )
    assert recv.handle(TransferStatusCmd(room)).room.error is None
    for t in plan:
        read_dst, read_src = (
            (dst.read_kv, src.read_kv) if t.kind == "kv" else (dst.read_index, src.read_index)
        )
        for run in t.runs:
            assert torch.equal(
                read_dst(t.layer, torch.arange(run.dst, run.dst + run.length)),
                read_src(t.layer, torch.tensor(list(run.src_rows()))),
            )
    recv.handle(ForgetCmd(room, quiesced=True))


def test_tcp_receiver_survives_any_frame(pools):
    cfg, src, dst = pools
    recv, sender = TcpReceiver(0, lambda: dst, key=KEY), TcpSender(0, src, key=KEY)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(recv.endpoint)
    rng, ticket, width = random.Random(3), new_ticket(), dst.kv.shape[-1]
    try:
        _, _, expected, slots = room_plan(cfg)
        recv.handle(ExpectCmd("fuzz", ticket, expected, slots))
        recv.handle(ExpectCmd("sentinel", ticket, {0: {0: 1}}, RoomSlots.of((15,), 4, 1, "copy")))
        for _ in range(FRAMES):
            header = fz.body(rng, lambda r: header_like(r, "fuzz", ticket, width, notif=False))
            payload = rng.randbytes(rng.choice([0, 8, 8 * width, 3 * 8 * width]))
            r = rng.random()
            tag = seal_data(KEY, header, payload) if r < 0.8 else rng.randbytes(32)
            push.send_multipart([header, payload, tag] if r < 0.95 else [header, tag])
        last = msgpack.packb(
            {
                "room": "sentinel",
                "ticket": ticket,
                "src_rank": 0,
                "layer": 0,
                "kind": "kv",
                "runs": [[60, 1]],
                "dtype": "torch.float64",
                "width": width,
                "seq": 0,
            }
        )
        push.send_multipart([last, bytes(8 * width), seal_data(KEY, last, bytes(8 * width))])
        wait_for(
            lambda: recv.handle(TransferStatusCmd("sentinel")).room.complete, what="the receiver stopped"
        )
        status = recv.handle(TransferStatusCmd("fuzz"))
        assert (
            status.counters["unauthenticated"] > FRAMES // 10 and status.counters["bad_frames"] > FRAMES // 4
        ), status
        assert recv.live.problem() is None and recv.live.crashes == 0
        check_delivery(recv, sender, "real", (5, 3, 4), cfg, src, dst)
    finally:
        push.close()
        ctx.destroy(linger=0)
        recv.close()
        sender.close()


def test_nixl_notification_receiver_survives_any_notification(pools):
    cfg, src, dst = pools
    recv = NixlReceiver(0, lambda: dst, staging_bytes=1 << 20, name="test-fuzz-decode", key=KEY)
    sender = NixlSender(0, src, staging_bytes=1 << 16, name="test-fuzz-prefill", key=KEY)
    fuzzer = make_agent("test-fuzz-notifier")
    rng, width = random.Random(4), dst.kv.shape[-1]
    try:
        _, rows, expected, slots = room_plan(cfg)
        ticket = new_ticket()
        recv.handle(StageCmd("fuzz", ticket, rows))
        recv.handle(ExpectCmd("fuzz", ticket, expected, slots))
        recv.handle(StageCmd("sentinel", ticket, {0: {"kv": 1}}))
        recv.handle(ExpectCmd("sentinel", ticket, {0: {0: 1}}, RoomSlots.of((15,), 4, 1, "copy")))
        fuzzer.add_remote_agent(recv.metadata)
        fuzzer.make_connection(recv.name)
        for _ in range(FRAMES):
            header = fz.body(rng, lambda r: header_like(r, "fuzz", ticket, width, notif=True))
            r = rng.random()
            msg = (
                seal_notif(KEY, header)
                if r < 0.8
                else header + rng.randbytes(32)
                if r < 0.95
                else rng.randbytes(8)
            )
            fuzzer.send_notif(recv.name, msg)
        last = msgpack.packb(
            {
                "room": "sentinel",
                "ticket": ticket,
                "src_rank": 0,
                "offset": 0,
                "nbytes": 8 * width,
                "dtype": "torch.float64",
                "items": [[0, "kv", width, [[60, 1]]]],
            }
        )
        fuzzer.send_notif(recv.name, seal_notif(KEY, last))
        # the fuzzer has no progress thread either: polling its notifications moves its sends along
        wait_for(
            lambda: (
                fuzzer.get_new_notifs() is None or recv.handle(TransferStatusCmd("sentinel")).room.complete
            ),
            what="the receiver stopped",
        )
        status = recv.handle(TransferStatusCmd("fuzz"))
        assert (
            status.counters["unauthenticated"] > FRAMES // 10 and status.counters["bad_frames"] > FRAMES // 4
        ), status
        assert recv.live.problem() is None and recv.live.crashes == 0
        for room in ("fuzz", "sentinel"):
            recv.handle(ForgetCmd(room, quiesced=True))
        check_delivery(recv, sender, "real", (5, 3, 4), cfg, src, dst)
    finally:
        try:
            fuzzer.remove_remote_agent(recv.name)
        except Exception:
            pass
        recv.close()
        sender.close()


def test_a_dead_receiver_thread_is_reported(pools):
    """ListenerStatusCmd (what DecodeInstance.listener_problem asks every rank, for /health) names a
    receiver thread that stopped."""
    _, _, dst = pools
    recv = TcpReceiver(0, lambda: dst, key=KEY)
    try:
        assert recv.handle(ListenerStatusCmd()) == ListenerStatus(alive=True, problem=None, crashes=0)
        recv._stop.set()  # the loop ends, as if the thread had died
        recv.thread.join(2)
        status = recv.handle(ListenerStatusCmd())
        assert not status.alive and "dead" in status.problem
    finally:
        recv.close()
