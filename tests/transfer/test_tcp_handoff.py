"""KV hand-off over the TCP data path between real rank processes (gloo + pyzmq on loopback).

After a hand-off from a prefill instance (C_p in {1, 2, 3}, full and layer-split) into a decode
instance ((W, C_d) in {(1,1), (2,2), (4,2)}, copy and split index): every decode rank's rows are
bit-identical to the prefill instance's rows of its tokens (the transfer itself is exact) and equal
the single-rank engine's within 1e-8 (prefill CP reorders float64 sums), and 12 greedy tokens
decoded after the hand-off equal the single-rank engine's `generate`. Faults: a corrupted payload,
data that never comes, late data for an aborted (or reused) room, a fingerprint mismatch; afterwards
both sides are back at idle (pages, held requests, receiver rooms). Every hand-off here runs the
production state machines (transfer/prefill_room.py, decode_room.py) over the real side channel
(tests/transfer/handoff_driver.py); the two_sided tests step them one call at a time.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from pdserve.request import SamplingParams
from pdserve.transfer.base import KVPoll
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.messages import TransferDone
from pdserve.transfer.plan import plan_transfer
from pdserve.transfer.rank_commands import SendError
from tests.reference import free_port
from tests.transfer.fault_loop import fault_loop_leaves_nothing_behind
from tests.transfer.handoff_driver import Driver, FaultySource, TransferError, hand_off
from tests.transfer.handoff_helpers import MAX_TOKENS, assert_idle, check_handoffs, prompt

pytestmark = pytest.mark.slow

# (decode (W, C_d), index mode, prefill (C_p, cache)): every decode shape, both index modes, every
# prefill shape and storage mode, without the full cross product (each instance is started once).
CASES = [
    ((1, 1), "copy", (1, "full")),
    ((2, 2), "split", (2, "layer-split")),
    ((2, 2), "copy", (3, "full")),
    ((4, 2), "copy", (2, "layer-split")),
    ((4, 2), "split", (3, "layer-split")),
    ((1, 1), "split", (2, "full")),
]


@pytest.mark.parametrize("dshape,index_mode,pshape", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_handoff_matches_single_rank(instances, single, dshape, index_mode, pshape):
    prefill, decode = instances.get_prefill(*pshape), instances.get_decode(*dshape, index_mode)
    check_handoffs(prefill, decode, single, f"{pshape}->{dshape}/{index_mode}")


@pytest.fixture()
def pair(instances):
    prefill, decode = instances.get_prefill(2, "full"), instances.get_decode(2, 2, "split")
    yield prefill, decode
    assert_idle(prefill, decode)  # every fault path released both sides


def test_corrupted_payload_is_rejected_and_released(pair):
    prefill, decode = pair
    corrupt = FaultySource(prefill, corrupt=True)  # flips a payload byte after the sender's checksum
    with pytest.raises(TransferError, match="checksum mismatch") as e:
        hand_off(prefill, decode, prompt(23), SamplingParams(max_tokens=4), source=corrupt)
    req_id = e.value.room
    assert decode.scheduler.abort(req_id) is None  # nothing of it left to decode
    ok = hand_off(prefill, decode, prompt(9), SamplingParams(max_tokens=4, ignore_eos=True))
    decode.run_until_idle()  # the instances stay healthy
    assert len(ok.output_ids) == 4


def test_data_that_never_comes_times_out(pair):
    prefill, decode = pair
    with pytest.raises(TransferError, match="transfer timeout"):
        hand_off(prefill, decode, prompt(9), timeout_s=0.3, source=FaultySource(prefill, skip_send=True))


def test_fingerprint_mismatch_is_refused(pair, monkeypatch):
    prefill, decode = pair
    monkeypatch.setattr(
        prefill, "worker", dataclasses.replace(prefill.worker, dtype="float32")
    )  # what it claims
    with pytest.raises(TransferError, match="model_dtype") as e:
        hand_off(prefill, decode, prompt(9))
    assert "'float32'" in str(e.value) and "'float64'" in str(e.value)


@pytest.mark.parametrize("reused", [False, True])
def test_late_data_for_an_aborted_room_is_dropped(pair, reused):
    prefill, decode = pair
    inst, ids = decode.instance, prompt(23)
    req = decode.submit_remote(len(ids), SamplingParams(max_tokens=2), request_id="late")
    decode.admit()
    reservation = inst.reservation("late", req.pages)
    res = prefill.prefill("late", ids)
    plan = plan_transfer(prefill.prefill_side(res.slots), inst.decode_side(req.pages), len(ids))
    inst.expect("late", reservation.ticket, plan, req.pages)
    slots = inst.slots(req.pages, len(ids))
    before = inst.dump(slots)
    inst.forget("late")  # decode aborts the room ...
    decode.abort("late")
    if reused:  # the room id is expected again, by a newer reservation (another ticket)
        inst.expect("late", new_ticket(), plan, req.pages)
    dropped = [s.counters["dropped"] for s in inst.transfer_status("late")]
    prefill.send("late", "late", reservation.ticket, plan, reservation.endpoints)  # ... then the data arrives
    frames = [sum(1 for t in plan if t.dst_rank == r) for r in range(len(dropped))]
    deadline = time.monotonic() + 10
    while [s.counters["dropped"] - d for s, d in zip(inst.transfer_status("late"), dropped)] != frames:
        assert time.monotonic() < deadline, "late frames were not all seen and dropped"
        time.sleep(0.01)
    for b, a in zip(before, inst.dump(slots)):  # nothing was written
        assert all(torch.equal(b.kv[l], a.kv[l]) for l in b.kv)
        assert all(torch.equal(b.index[l], a.index[l]) for l in b.index)
    if reused:
        assert all(s.room.known and s.room.rows == 0 for s in inst.transfer_status("late"))
        inst.forget("late")
    prefill.release("late")


def test_dead_decode_endpoint_fails_the_room_not_the_instance(pair):
    prefill, decode = pair
    ids = prompt(23)
    res = prefill.prefill("dead", ids)
    plan = plan_transfer(
        prefill.prefill_side(res.slots), decode.instance.decode_side([0, 1, 2, 3, 4, 5]), len(ids)
    )
    endpoints = {r: f"tcp://127.0.0.1:{free_port()}" for r in range(2)}  # nobody listens there
    with pytest.raises(SendError, match="not receiving"):
        prefill.send("dead", "dead", 1, plan, endpoints, send_timeout_ms=200)
    assert prefill.ranks.broken is None  # the rank group still serves other requests
    prefill.release("dead")
    ok = hand_off(prefill, decode, ids, SamplingParams(max_tokens=2, ignore_eos=True))
    decode.run_until_idle()
    assert len(ok.output_ids) == 2


def test_many_mixed_faults_leave_nothing_behind(pair, instances, single):
    """200 seeded cases through the production machines (tests/transfer/fault_loop.py): successes and
    every fault kind, on the same instances; the `pair` fixture then checks both sides are idle
    (docs/design.md invariant 7)."""
    fault_loop_leaves_nothing_behind(
        instances, pair, "tcp", seed=0, kill_shape=(2, "layer-split"), single=single
    )


# ---- the machines stepped one by one, as the two servers' threads step them -------------------
@pytest.fixture()
def driver(pair):
    d = Driver(*pair)
    yield d
    d.close()


def test_two_sided_handoff_over_side_channel(pair, driver, single):
    prefill, decode = pair
    ids, params = prompt(23), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    d = driver.submit(ids, params, "two-sided", timeout_s=10)
    assert d.state is KVPoll.WaitingForInput  # admitted and reserved in the same step
    p = driver.prefill_rooms.open("two-sided", ids, params, bootstrap_timeout_s=5)
    assert driver.claim(p, d) is KVPoll.WaitingForInput
    sent = p.run()
    assert isinstance(sent, TransferDone) and not prefill.held  # prefill released as soon as it sent
    req = driver.finish(d)
    decode.run_until_idle()
    assert req.output_ids == single.generate([ids], [params])[0]


def test_two_sided_bootstrap_timeout_holds_nothing(pair, driver):
    p = driver.prefill_rooms.open("nobody-reserved", prompt(9), None, bootstrap_timeout_s=0.2)
    deadline = time.monotonic() + 5
    while p.poll() is KVPoll.Bootstrapping:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert p.state is KVPoll.Failed and "bootstrap timeout" in p.s.reason
    driver.prefill_rooms.close("nobody-reserved")
    assert not driver.prefill_rooms.rooms and not pair[0].held


@pytest.mark.parametrize("fault", ["fingerprint", "corrupt", "never"])
def test_two_sided_faults_release_both_sides(pair, driver, monkeypatch, fault):
    prefill, _ = pair
    if fault == "fingerprint":
        monkeypatch.setattr(prefill, "worker", dataclasses.replace(prefill.worker, dtype="float32"))
    ids, room = prompt(9), f"fault-{fault}"
    d = driver.submit(ids, SamplingParams(), room, timeout_s=0.3 if fault == "never" else 10)
    p = driver.prefill_rooms.open(room, ids, None, bootstrap_timeout_s=5)
    p.source = FaultySource(prefill, corrupt=fault == "corrupt")
    assert driver.claim(p, d) is KVPoll.WaitingForInput
    if fault != "never":  # "never": the prefill never answers; decode times out and tells it
        p.run()
    want = {"fingerprint": "model_dtype", "corrupt": "checksum mismatch", "never": "transfer timeout"}[fault]
    with pytest.raises(TransferError, match=want):
        driver.finish(d)
    if fault == "never":
        wait = time.monotonic() + 5
        while p.poll() is not KVPoll.Failed:
            assert time.monotonic() < wait
            driver.server.drain(10)
        assert "transfer timeout" in p.s.reason
    driver.prefill_rooms.close(room)
    server = driver.server
    wait = time.monotonic() + 5
    while server.reservations or server.peers or server.aborted:  # decode's TransferFailed is not kept
        assert time.monotonic() < wait, (server.reservations, server.aborted)
        driver.prefill_rooms.tidy()
        server.drain(10)
    client = driver.rooms.clients[server.endpoint]
    assert not client.outcomes and not client.open and not driver.prefill_rooms.rooms
