"""Receivers write only into the slots of the room the rows are for (docs/design.md invariant 11, issue 13
item 3). A sender that holds one room's ticket aims that room's rows at another request's slots:
the frames are refused before a byte is written, the sender's room fails, and the victim's rows
and greedy tokens are unchanged -- over TCP with real rank processes, and for NIXL notifications
(in both landing modes: a notification whose runs lie outside the room's pages fails the room;
with region landing nothing reaches the pool at all)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.request import SamplingParams
from pdserve.serving.auth import frame_key
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.nixl import NixlReceiver
from pdserve.transfer.nixl_send import NixlSender
from pdserve.transfer.plan import DecodeSide, PrefillSide, plan_transfer
from pdserve.transfer.rank_commands import (
    ExpectCmd,
    ForgetCmd,
    SendCmd,
    StageCmd,
    TransferStatusCmd,
)
from pdserve.transfer.room_rows import RoomSlots
from pdserve.transfer.tcp import (
    TcpReceiver,
    TcpSender,
)
from tests.transfer.handoff_driver import hand_off
from tests.transfer.handoff_helpers import MAX_TOKENS, assert_idle, prompt

pytestmark = pytest.mark.slow


def wait_error(status, timeout_s: float = 10.0) -> list[str]:
    """The ranks' errors for a room, once at least one rank reports one."""
    deadline = time.monotonic() + timeout_s
    while not (errors := [s.room.error for s in status() if s.room.error]):
        assert time.monotonic() < deadline, status()
        time.sleep(0.01)
    return errors


def test_tcp_rows_for_another_requests_slots_fail_the_senders_room(instances, single):
    prefill, decode = instances.get_prefill(2, "full"), instances.get_decode(2, 2, "split")
    inst, ids = decode.instance, prompt(23)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    victim = hand_off(prefill, decode, ids, params, room="victim")  # delivered, not decoded yet
    slots = inst.slots(victim.pages, len(ids))
    before = inst.dump(slots)
    evil_ids = prompt(22)
    evil = decode.submit_remote(len(evil_ids), SamplingParams(max_tokens=1), request_id="evil")
    decode.admit()
    reservation = inst.reservation("evil", evil.pages, prompt_len=len(evil_ids))
    inst.expect_totals("evil", reservation.ticket, evil.pages, len(evil_ids))
    res = prefill.prefill("evil-sender", evil_ids)
    aimed = plan_transfer(prefill.prefill_side(res.slots), inst.decode_side(victim.pages), len(evil_ids))
    prefill.send(
        "evil-sender", "evil", reservation.ticket, aimed, reservation.endpoints
    )  # a valid ticket, wrong rows
    errors = wait_error(lambda: inst.transfer_status("evil"))
    assert all("not the room's" in e for e in errors), errors
    assert all(s.room.rows == 0 for s in inst.transfer_status("evil"))
    for b, a in zip(before, inst.dump(slots)):  # nothing of the victim was written
        assert all(torch.equal(b.kv[l], a.kv[l]) for l in b.kv)
        assert all(torch.equal(b.index[l], a.index[l]) for l in b.index)
    prefill.release("evil-sender")
    decode.abort("evil", inst.forget("evil", quiesced=True))
    decode.run_until_idle()
    assert victim.output_ids == single.generate([ids], [params])[0]
    assert_idle(prefill, decode)


@pytest.mark.parametrize("direct", [False, True], ids=["region", "pool"])
def test_nixl_notification_outside_the_room_fails_it(pools, direct):
    """Rooms A (pages 0-2) and B (pages 3-5) on one receiver. B's sender WRITEs A's plan with B's
    ticket: the notification claims A's rows, so B fails and A's status is untouched; with region
    landing the pool keeps no byte of it. A's own hand-off then arrives exact."""
    cfg, src, dst = pools
    prefill_side = PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(20, 32))
    plans = {
        room: plan_transfer(prefill_side, DecodeSide(1, 1, "copy", 4, pages), 12)
        for room, pages in (("A", (0, 1, 2)), ("B", (3, 4, 5)))
    }
    rows: dict[str, int] = {}
    for t in plans["A"]:
        rows[t.kind] = rows.get(t.kind, 0) + t.rows
    tag = "region" if not direct else "pool"
    recv = NixlReceiver(0, lambda: dst, staging_bytes=1 << 20, name=f"test-slots-d-{tag}", direct=direct)
    sender = NixlSender(0, src, staging_bytes=1 << 16, name=f"test-slots-p-{tag}")
    try:
        tickets, endpoints = {}, {}
        for room, pages in (("A", (0, 1, 2)), ("B", (3, 4, 5))):
            tickets[room] = new_ticket()
            endpoints[room] = recv.handle(StageCmd(room, tickets[room], {0: rows})).endpoint
            recv.handle(
                ExpectCmd(
                    room, tickets[room], {0: {0: sum(rows.values())}}, RoomSlots.of(pages, 4, 1, "copy")
                )
            )
        reply = sender.send(SendCmd("B", tickets["B"], plans["A"], {0: endpoints["B"]}))
        assert reply.error is None, reply
        errors = wait_error(lambda: [recv.handle(TransferStatusCmd("B"))])
        assert "not the room's" in errors[0]
        status = recv.handle(TransferStatusCmd("A"))
        assert status.room.error is None and status.room.rows == 0
        if not direct:  # region landing: the refused chunk never left B's region
            assert not dst.kv.any() and not dst.index_k.any()
        reply = sender.send(SendCmd("A", tickets["A"], plans["A"], {0: endpoints["A"]}))
        deadline = time.monotonic() + 5
        while not recv.handle(TransferStatusCmd("A")).room.complete:
            assert time.monotonic() < deadline, recv.handle(TransferStatusCmd("A"))
            time.sleep(0.002)
        for t in plans["A"]:
            read_dst, read_src = (
                (dst.read_kv, src.read_kv) if t.kind == "kv" else (dst.read_index, src.read_index)
            )
            for run in t.runs:
                got = read_dst(t.layer, torch.arange(run.dst, run.dst + run.length))
                assert torch.equal(got, read_src(t.layer, torch.tensor(list(run.src_rows()))))
        for room in ("A", "B"):
            recv.handle(ForgetCmd(room, quiesced=True))
    finally:
        recv.close()
        sender.close()


def test_room_slots_cover_exactly_the_rooms_pages():
    s = RoomSlots.of((2, 5), page_size=8, dcp_size=2, index_mode="split")
    s.check("kv", 8, 4)  # page 2 holds latent rows 8..11 on every DCP rank
    s.check("kv", 20, 4)
    for dst, n in ((7, 2), (12, 1), (0, 1), (8, 5), (19, 2)):
        with pytest.raises(ValueError, match="not the room's"):
            s.check("kv", dst, n)
    c = RoomSlots.of((2,), page_size=8, dcp_size=2, index_mode="copy")
    c.check("index", 16, 8)  # a copied index keeps every slot of the page
    with pytest.raises(ValueError):
        c.check("index", 24, 1)
    with pytest.raises(ValueError):
        c.check("other", 16, 1)
    c.check("kv", 1 << 39, 0)  # an empty run touches no row


def test_data_frames_without_the_key_are_dropped_unread(pools):
    """A sender with another cluster's key, the right room, ticket and rows: every frame is dropped
    before it is decoded (counted `unauthenticated`), nothing is written, the room stays open."""
    cfg, src, dst = pools
    plan = plan_transfer(
        PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(20, 32)),
        DecodeSide(1, 1, "copy", 4, (0, 1, 2)),
        12,
    )
    key = frame_key("the-cluster-token-for-these-tests-0123")
    recv = TcpReceiver(0, lambda: dst, key=key)
    foreign = TcpSender(0, src, key=frame_key("another-clusters-token-0123456789"))
    try:
        ticket = new_ticket()
        recv.handle(
            ExpectCmd("r", ticket, {0: {0: sum(t.rows for t in plan)}}, RoomSlots.of((0, 1, 2), 4, 1, "copy"))
        )
        assert foreign.send(SendCmd("r", ticket, plan, {0: recv.endpoint})).error is None
        deadline = time.monotonic() + 5
        while recv.handle(TransferStatusCmd("r")).counters["unauthenticated"] < len(plan):
            assert time.monotonic() < deadline, recv.handle(TransferStatusCmd("r"))
            time.sleep(0.005)
        status = recv.handle(TransferStatusCmd("r"))
        assert status.room.rows == 0 and status.room.error is None and status.counters["bad_frames"] == 0
        assert not dst.kv.any() and not dst.index_k.any()
    finally:
        recv.close()
        foreign.close()
