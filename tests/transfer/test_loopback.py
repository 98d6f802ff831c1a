"""The transfer state machine on the in-process loopback backend: the success path, bootstrap and
transfer timeouts, aborts from either side, a refused fingerprint, a corrupted payload, and a late
completion for an aborted (and reused) room, which is ignored."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.transfer.base import IllegalTransition, KVPoll, TransferState
from pdserve.transfer.loopback import LoopbackBus, LoopbackReceiver, LoopbackSender
from pdserve.transfer.messages import DecodeReservation, Fingerprint

FP = Fingerprint("hash", "auto", "float64", 4, 2, 2, "copy")
FRAMES = [(0, 0, "kv", b"abc"), (1, 0, "kv", b"def"), (0, 1, "index", b"gh")]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def reservation(room="r1", fp=FP):
    return DecodeReservation(room, fp, 1, 2, 2, 4, (3, 7), {0: "loop://0", 1: "loop://1"})


def pair(clock, room="r1", sender_fp=FP):
    bus = LoopbackBus()
    sender = LoopbackSender(bus, room, sender_fp, bootstrap_timeout_s=5, clock=clock)
    recv = LoopbackReceiver(bus, reservation(room), transfer_timeout_s=10, clock=clock)
    return bus, sender, recv


def test_state_transitions_are_checked():
    s = TransferState("r")
    with pytest.raises(IllegalTransition):
        s.advance(KVPoll.Success)  # only from Transferring
    with pytest.raises(IllegalTransition):
        s.advance(KVPoll.Failed)
    s.advance(KVPoll.WaitingForInput)
    s.advance(KVPoll.Transferring)
    assert s.fail("boom") and s.state is KVPoll.Failed
    assert not s.fail("second") and s.reason == "boom"  # Failed never reverts, first reason kept
    with pytest.raises(IllegalTransition):
        s.advance(KVPoll.Success)


def test_success_path():
    clock = Clock()
    bus, sender, recv = pair(clock)
    assert sender.poll() is KVPoll.WaitingForInput and recv.poll() is KVPoll.WaitingForInput
    sender.send(FRAMES)
    assert recv.poll() is KVPoll.Transferring
    assert sender.finish(first_token=11) and sender.poll() is KVPoll.Success
    assert recv.poll() is KVPoll.Success and recv.first_token == 11 and recv.frames == FRAMES
    assert not bus.rooms  # nothing left behind


def test_bootstrap_timeout():
    clock = Clock()
    sender = LoopbackSender(LoopbackBus(), "r1", FP, bootstrap_timeout_s=5, clock=clock)
    assert sender.poll() is KVPoll.Bootstrapping
    clock.t = 6
    assert sender.poll() is KVPoll.Failed and "bootstrap timeout" in sender.failure_reason


def test_transfer_timeout_tells_the_sender():
    clock = Clock()
    bus, sender, recv = pair(clock)
    sender.poll()
    clock.t = 11
    assert recv.poll() is KVPoll.Failed and "transfer timeout" in recv.failure_reason
    assert sender.poll() is KVPoll.Failed and "transfer timeout" in sender.failure_reason
    assert not bus.rooms


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_from_either_side(side):
    clock = Clock()
    bus, sender, recv = pair(clock)
    sender.poll()
    sender.send(FRAMES[:1])
    (sender if side == "sender" else recv).abort(f"aborted by {side}")
    assert sender.poll() is KVPoll.Failed and recv.poll() is KVPoll.Failed
    assert f"aborted by {side}" in sender.failure_reason and f"aborted by {side}" in recv.failure_reason
    assert not sender.finish(3) and recv.first_token is None
    assert not bus.rooms


def test_fingerprint_mismatch_is_refused():
    clock = Clock()
    bus, sender, recv = pair(clock, sender_fp=dataclasses.replace(FP, index_mode="split"))
    assert sender.poll() is KVPoll.Failed and "index_mode" in sender.failure_reason
    assert recv.poll() is KVPoll.Failed and "index_mode" in recv.failure_reason
    assert not bus.rooms


def test_corrupted_payload_fails_the_checksum():
    clock = Clock()
    bus, sender, recv = pair(clock)
    sender.poll()
    sender.send(FRAMES)
    bus.rooms["r1"].frames[1] = (1, 0, "kv", b"dXf")  # flipped in flight
    sender.finish(5)
    assert recv.poll() is KVPoll.Failed and "checksum mismatch" in recv.failure_reason
    assert recv.frames == [] and recv.first_token is None  # nothing handed to decode


def test_late_completion_for_an_aborted_and_reused_room_is_ignored():
    clock = Clock()
    bus, old_sender, recv = pair(clock)
    old_sender.poll()
    old_sender.send(FRAMES)
    recv.abort()
    fresh = LoopbackReceiver(bus, reservation(), transfer_timeout_s=10, clock=clock)  # room id reused
    assert not old_sender.finish(99)  # the late completion
    assert fresh.poll() is KVPoll.WaitingForInput and bus.rooms["r1"].frames == []
    new_sender = LoopbackSender(bus, "r1", FP, clock=clock)
    new_sender.poll()
    new_sender.send(FRAMES[:2])
    new_sender.finish(7)
    assert fresh.poll() is KVPoll.Success and fresh.first_token == 7 and fresh.frames == FRAMES[:2]
