"""KV hand-off over the NIXL data path (transfer/nixl.py: UCX, host DRAM, no progress thread).

Between real rank processes, the same hand-off as over TCP (the cases run for both data paths on
the same shapes): C_p=2 full cache into (W, C_d)=(2, 2) with a copied index, C_p=3 layer-split into
(4, 2) with a split index; every decode rank's rows equal the prefill's exactly and the single-rank
engine's float64 rows, and 12 greedy tokens match. NIXL faults: a corrupted payload (checksum), a
decode rank killed while a WRITE to it is in flight, a stale WRITE for an aborted room whose id and
pages were reused by a live request (ignored: the live request decodes exactly), and a loop of
failures after which both sides' staging, handles and registrations are back at idle. In one
process, with real agents: a restarted peer (same name, new generation) is reloaded before it is
written, an older generation is refused, and a full receive arena refuses a room until a forgotten
region's quarantine has passed.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.nixl import NixlReceiver
from pdserve.transfer.nixl_send import NixlSender
from pdserve.transfer.plan import DecodeSide, PrefillSide, plan_transfer
from pdserve.transfer.rank_commands import (
    ExpectCmd,
    ForgetCmd,
    SendCmd,
    SendError,
    StageCmd,
    TransferStatusCmd,
    merge_checksums,
)
from pdserve.transfer.room_rows import RoomSlots
from tests.reference import free_port
from tests.transfer.fault_loop import fault_loop_leaves_nothing_behind
from tests.transfer.handoff_driver import Driver, FaultySource, TransferError, hand_off
from tests.transfer.handoff_helpers import (
    MAX_TOKENS,
    QUARANTINE_S,
    assert_idle,
    check_handoffs,
    prompt,
)

pytestmark = pytest.mark.slow

CASES = [((2, 2), "copy", (2, "full")), ((4, 2), "split", (3, "layer-split"))]


@pytest.fixture(scope="module", autouse=True)
def close_nixl_instances(instances):
    yield
    instances.close("nixl")  # the TCP ones stay for test_tcp_handoff.py


@pytest.mark.parametrize(
    "dshape,index_mode,pshape,transfer",
    [(*c, "nixl") for c in CASES] + [(*CASES[0], "tcp")],  # CASES[1] over TCP: test_tcp_handoff.py
    ids=lambda v: str(v).replace(" ", ""),
)
def test_handoff_matches_single_rank_over_both_paths(instances, single, dshape, index_mode, pshape, transfer):
    prefill = instances.get_prefill(*pshape, transfer=transfer)
    decode = instances.get_decode(*dshape, index_mode, transfer=transfer)
    check_handoffs(prefill, decode, single, f"{transfer}: {pshape}->{dshape}/{index_mode}")


@pytest.fixture()
def pair(instances):
    prefill, decode = instances.get_prefill(2, "full", "nixl"), instances.get_decode(2, 2, "copy", "nixl")
    yield prefill, decode
    assert_idle(prefill, decode)  # every fault path released staging, handles and rooms on both sides


def test_corrupted_payload_is_rejected(pair):
    prefill, decode = pair
    corrupt = FaultySource(prefill, corrupt=True)  # flips a payload byte after the sender's checksum
    with pytest.raises(TransferError, match="checksum mismatch"):
        hand_off(prefill, decode, prompt(23), SamplingParams(max_tokens=4), source=corrupt)


def test_stale_write_for_a_reused_room_never_reaches_the_live_request(pair, single):
    """Room "late" is dropped after its reservation, while its prefill could still send (not
    quiesced): its pages are held, not freed. The same room id is then handed off again (new
    ticket, other pages) and runs. Only then does the first sender WRITE its rows, through the first
    reservation's endpoints: they land in the held pages and their notifications are dropped; the
    live request's rows and tokens are untouched, and the held pages come back after the quarantine."""
    prefill, decode = pair
    inst, old_ids, ids = decode.instance, prompt(23), prompt(22)
    old = decode.submit_remote(len(old_ids), SamplingParams(max_tokens=MAX_TOKENS + 8), request_id="late")
    decode.admit()
    old_pages = list(old.pages)
    stale = inst.reservation("late", old_pages, prompt_len=len(old_ids))
    res = prefill.prefill("stale-sender", old_ids)
    plan = plan_transfer(prefill.prefill_side(res.slots), inst.decode_side(old_pages), len(old_ids))
    inst.expect("late", stale.ticket, plan, old_pages)
    hold_s = inst.forget("late")  # decode drops the room; the prefill has not sent yet
    assert hold_s == QUARANTINE_S
    decode.abort("late", hold_s)
    assert inst.allocator.num_held == len(old_pages)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    live = hand_off(prefill, decode, ids, params, room="late")
    assert not set(live.pages) & set(old_pages)
    slots = inst.slots(live.pages, len(ids))
    before, dropped = inst.dump(slots), [s.counters["dropped"] for s in inst.transfer_status("late")]
    prefill.send("stale-sender", "late", stale.ticket, plan, stale.endpoints)  # the late WRITEs
    chunks = [len({t.src_rank for t in plan if t.dst_rank == r}) for r in range(len(dropped))]
    deadline = time.monotonic() + 10
    while [s.counters["dropped"] - d for s, d in zip(inst.transfer_status("late"), dropped)] != chunks:
        assert time.monotonic() < deadline, "the late notifications were not all seen and dropped"
        time.sleep(0.01)
    for b, a in zip(before, inst.dump(slots)):
        assert all(torch.equal(b.kv[l], a.kv[l]) for l in b.kv)
        assert all(torch.equal(b.index[l], a.index[l]) for l in b.index)
    prefill.release("stale-sender")
    decode.run_until_idle()
    assert live.output_ids == single.generate([ids], [params])[0]


def test_many_failures_leave_nothing_behind(pair, instances, single):
    """200 seeded hand-offs through the production machines (tests/transfer/fault_loop.py), successes
    and failures of every kind -- rooms dropped mid-send hold their pages for the quarantine -- then
    the `pair` fixture checks pages (after the hold expired), staging, xfer handles, rooms and
    registrations on both sides are back at idle (docs/design.md invariant 7)."""
    fault_loop_leaves_nothing_behind(
        instances, pair, "nixl", seed=1, kill_shape=(3, "layer-split"), single=single
    )


def test_two_sided_handoff_over_nixl(pair, single):
    prefill, decode = pair
    driver = Driver(prefill, decode)
    try:
        ids, params = prompt(23), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        d = driver.submit(ids, params, "two-sided-nixl", timeout_s=10)
        p = driver.prefill_rooms.open("two-sided-nixl", ids, params, bootstrap_timeout_s=5)
        driver.claim(p, d)
        p.run()
        req = driver.finish(d)
        decode.run_until_idle()
        assert req.output_ids == single.generate([ids], [params])[0]
    finally:
        driver.close()


def test_decode_rank_killed_mid_write(pair, model_path):
    """The victim's rank is stopped, a WRITE to it is posted (it cannot complete), then the rank is
    killed: the send fails for that room only, its handle is released and the dead peer dropped."""
    prefill, decode = pair
    peers = [s.counters["peers"] for s in prefill.transfer_status()]
    cfg = DecodeWorkerConfig(
        model_path, num_slots=1024, dtype="float64", float32_islands=False, transfer="nixl"
    )
    victim = DecodeStepDriver(DecodeInstance(cfg, LaunchConfig(1, free_port()), page_size=4).start())
    try:
        ok = hand_off(
            prefill, victim, prompt(9), SamplingParams(max_tokens=1)
        )  # the victim is a loaded peer now
        assert ok.state == "finished"
        ids = prompt(400)  # big enough that UCX needs the target's help (rendezvous), not an eager send
        req = victim.submit_remote(len(ids), SamplingParams(max_tokens=1), request_id="victim")
        victim.admit()
        reservation = victim.instance.reservation("victim", req.pages, prompt_len=len(ids))
        res = prefill.prefill("victim", ids)
        plan = plan_transfer(
            prefill.prefill_side(res.slots), victim.instance.decode_side(req.pages), len(ids)
        )
        victim.instance.expect("victim", reservation.ticket, plan, req.pages)
        pid = victim.instance.ranks.pids[0]
        os.kill(pid, signal.SIGSTOP)
        outcome = {}

        def send():
            try:
                outcome["sums"] = prefill.send(
                    "victim",
                    "victim",
                    reservation.ticket,
                    plan,
                    reservation.endpoints,
                    send_timeout_ms=20_000,
                )
            except SendError as e:
                outcome["error"] = str(e)

        sender = threading.Thread(target=send)
        t0 = time.monotonic()
        sender.start()
        sender.join(0.5)
        assert sender.is_alive(), "the WRITE completed although its target was stopped"
        os.kill(pid, signal.SIGKILL)
        sender.join(30)
        assert "decode rank 0" in outcome.get("error", ""), outcome
        assert time.monotonic() - t0 < 20, "the dead peer was only noticed by the deadline"
        prefill.release("victim")
    finally:
        victim.instance.shutdown()
    assert prefill.ranks.broken is None
    # each prefill rank whose WRITE failed dropped the dead peer; a rank whose share landed before the
    # kill (a shared-memory transport can write into a stopped process) still knows it, unused
    failed = {int(r) for r in re.findall(r"prefill rank (\d+):", outcome["error"])}
    after = [s.counters["peers"] for s in prefill.transfer_status()]
    assert failed and all(after[r] == peers[r] for r in failed), (outcome["error"], peers, after)
    assert all(after[r] <= peers[r] + 1 for r in range(len(peers))), (peers, after)
    again = hand_off(prefill, decode, prompt(9), SamplingParams(max_tokens=2, ignore_eos=True))
    decode.run_until_idle()
    assert len(again.output_ids) == 2


# ---- one process, real agents: peer generations, arena exhaustion and quarantine --------------------
def one_room(cfg, n: int = 12) -> tuple[list, dict, dict]:
    """A plan for n tokens from one prefill rank to one decode rank, its staging rows and expectations."""
    plan = plan_transfer(
        PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(20, 20 + n)),
        DecodeSide(1, 1, "copy", 4, (2, 0, 1)),
        n,
    )
    rows: dict[str, int] = {}
    for t in plan:
        rows[t.kind] = rows.get(t.kind, 0) + t.rows
    return plan, {0: rows}, {0: {0: sum(rows.values())}}


ONE_ROOM_SLOTS = RoomSlots.of((2, 0, 1), 4, 1, "copy")
T1, T2 = new_ticket(), new_ticket()


def deliver(recv: NixlReceiver, sender: NixlSender, room: str, ticket: bytes, plan, rows, expected) -> dict:
    ep = recv.handle(StageCmd(room, ticket, rows))
    assert ep.error is None, ep
    recv.handle(ExpectCmd(room, ticket, expected, ONE_ROOM_SLOTS))
    before = time.monotonic()
    reply = sender.send(SendCmd(room, ticket, plan, {0: ep.endpoint}))
    sent = time.monotonic()
    began, ended = sender.status()["last_send_began"], sender.status()["last_send_ended"]
    assert before <= began <= ended <= sent  # the send's own clock, which bench/transfer.py reads
    if reply.error is None:
        deadline = time.monotonic() + 5
        while not recv.handle(TransferStatusCmd(room)).room.complete:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        status = recv.handle(TransferStatusCmd(room))
        assert status.room.checksum == merge_checksums([reply])[0]
        assert before <= status.room.first_row_at <= status.room.last_row_at <= time.monotonic()
    return {"reply": reply, "endpoint": ep.endpoint}


def test_restarted_peer_is_reloaded_and_an_old_generation_refused(pools):
    cfg, src, dst = pools
    plan, rows, expected = one_room(cfg)
    sender = NixlSender(0, src, staging_bytes=4096, name="test-prefill")  # small: several chunks per room
    first = NixlReceiver(0, lambda: dst, staging_bytes=1 << 20, name="test-decode")
    try:
        old = deliver(first, sender, "a", T1, plan, rows, expected)
        assert old["reply"].error is None and sender.status()["peers"] == 1
        first.handle(ForgetCmd("a", quiesced=True))
        first.close()
        dst.kv.zero_()
        second = NixlReceiver(
            0, lambda: dst, staging_bytes=1 << 20, name="test-decode"
        )  # same name, restarted
        try:
            new = deliver(second, sender, "b", T2, plan, rows, expected)
            assert new["reply"].error is None and sender.status()["reloads"] == 1
            assert torch.equal(
                dst.read_kv(0, torch.tensor([8, 9, 10, 11, 0])), src.read_kv(0, torch.arange(20, 25))
            )
            reply = sender.send(
                SendCmd("a", T1, plan, {0: old["endpoint"]})
            )  # the first incarnation's endpoint
            assert "stale endpoint" in reply.error
            assert (
                sender.status()["xfer_handles"] == 0
                and second.handle(TransferStatusCmd("b")).counters["dropped"] == 0
            )
        finally:
            second.close()
    finally:
        sender.close()


def test_full_arena_refuses_a_room_until_the_quarantine_passed(pools):
    cfg, src, dst = pools
    plan, rows, expected = one_room(cfg)
    recv = NixlReceiver(
        0, lambda: dst, staging_bytes=30_000, name="test-small-arena", quarantine_s=0.3, direct=False
    )  # WRITEs into regions (what an fp8 pool gets)
    try:
        assert recv.handle(StageCmd("a", T1, rows)).error is None  # 18 kB of 30 kB
        assert "receive staging full" in recv.handle(StageCmd("b", T2, rows)).error
        recv.handle(ForgetCmd("a"))  # not quiesced: a sender may still write into it
        status = recv.handle(TransferStatusCmd("x"))
        assert status.counters["quarantined"] == 1 and status.counters["staging_bytes"] > 0
        assert "receive staging full" in recv.handle(StageCmd("b", T2, rows)).error
        deadline = time.monotonic() + 5
        while recv.handle(TransferStatusCmd("x")).counters["quarantined"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert recv.handle(StageCmd("b", T2, rows)).error is None
        recv.handle(ForgetCmd("b", quiesced=True))
        assert recv.handle(TransferStatusCmd("x")).counters["staging_bytes"] == 0
    finally:
        recv.close()
