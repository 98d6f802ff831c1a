"""The production hand-off machines (transfer/prefill_room.py, transfer/decode_room.py) over the real
side channel in one process, with the fake source / destination of tests/transfer/fakes.py: the
success path, bootstrap and transfer timeouts, aborts from either side, a refused fingerprint, and
a late outcome of an earlier use of a room id, which is ignored. The same machines run with real
ranks in test_tcp_handoff.py / test_nixl_handoff.py."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.transfer.base import IllegalTransition, KVPoll, TransferState
from pdserve.transfer.decode_client import DecodeClient
from pdserve.transfer.decode_room import DecodeRoom
from pdserve.transfer.prefill_room import PrefillRooms
from pdserve.transfer.side_channel import BootstrapServer
from tests.transfer.fakes import FakeDestination, FakeSource

IDS = list(range(9))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def world():
    server = BootstrapServer()
    client = DecodeClient(server.endpoint)
    assert client.wait_ready(5, server.drain)
    dest = FakeDestination()
    source = FakeSource(dest)
    yield server, client, dest, source
    client.close()
    server.close()


def until(cond, server, wait_s=5.0):
    deadline = time.monotonic() + wait_s
    while not cond():
        assert time.monotonic() < deadline
        server.drain(2)


def reserved(world, room="r1", timeout_s=10.0, clock=time.monotonic):
    server, client, dest, source = world
    rooms = PrefillRooms(source, server, clock)
    p = rooms.open(room, IDS, None, bootstrap_timeout_s=5)
    dest.submit(room, len(IDS), None)
    d = DecodeRoom(dest, room, len(IDS), server.endpoint, timeout_s, clock)
    assert d.poll(client, 5) is KVPoll.WaitingForInput
    until(lambda: p.poll() is not KVPoll.Bootstrapping, server)
    return rooms, p, d


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


def test_success_path(world):
    server, client, dest, source = world
    _, p, d = reserved(world)
    assert p.state is KVPoll.WaitingForInput
    assert p.run().first_token == 7 and p.state is KVPoll.Success and not source.held
    deadline = time.monotonic() + 5
    while d.poll(client, 5) is not KVPoll.Success:
        assert time.monotonic() < deadline and d.state is not KVPoll.Failed, d.s.reason
    assert dest.committed == {"r1": 7} and not dest.rooms and not dest.pages  # nothing left behind
    assert not server.reservations and not client.open


def test_bootstrap_timeout(world):
    server, _, _, source = world
    clock = Clock()
    p = PrefillRooms(source, server, clock).open("lonely", IDS, None, bootstrap_timeout_s=5)
    assert p.poll() is KVPoll.Bootstrapping
    clock.t = 6
    assert p.poll() is KVPoll.Failed and "bootstrap timeout" in p.s.reason


def test_rows_that_never_come_time_out_and_release(world):
    server, client, dest, source = world
    clock = Clock()
    source.send_rows = False
    _, p, d = reserved(world, clock=clock)
    p.run()
    never = 1e9  # heartbeats are timed on the real clock; this test moves a fake one
    until(lambda: d.poll(client, never) is KVPoll.Transferring, server)
    clock.t = 11
    assert d.poll(client, never) is KVPoll.Failed and "transfer timeout" in d.s.reason
    assert dest.released == {"r1": 0.0}  # the prefill answered: quiesced, no hold


def test_decode_abort_reaches_the_prefill(world):
    server, client, dest, source = world
    _, p, d = reserved(world)
    assert d.abort(client) and dest.released == {"r1": 1.5}  # not quiesced: the pages are held
    until(lambda: p.poll() is KVPoll.Failed, server)
    assert "aborted by the decode instance" in p.s.reason and not source.held


def test_prefill_abort_before_the_reservation_is_answered_late(world):
    server, client, dest, source = world
    rooms = PrefillRooms(source, server)
    rooms.open("early", IDS, None, bootstrap_timeout_s=5)
    assert rooms.abort("early") and "early" in rooms.dropped
    dest.submit("early", len(IDS), None)
    d = DecodeRoom(dest, "early", len(IDS), server.endpoint, 10)
    d.poll(client, 5)
    until(lambda: (rooms.tidy(), d.poll(client, 5))[1] is KVPoll.Failed, server)
    assert "aborted by the prefill instance" in d.s.reason and not rooms.dropped


def test_refused_fingerprint_fails_both_sides(world):
    server, client, dest, source = world
    source.fp = dataclasses.replace(source.fp, index_mode="split")
    _, p, d = reserved(world)
    assert p.run().reason and p.state is KVPoll.Failed and "index_mode" in p.s.reason
    until(lambda: d.poll(client, 5) is KVPoll.Failed, server)
    assert "index_mode" in d.s.reason


def test_outcome_of_an_earlier_use_of_the_room_id_is_ignored(world):
    server, client, dest, source = world
    _, p, d = reserved(world)
    d.abort(client)
    until(lambda: p.poll() is KVPoll.Failed, server)  # its TransferFailed goes to the old room
    _, p2, d2 = reserved(world)  # the same id again: a new ticket
    p2.run()
    until(lambda: d2.poll(client, 5) is KVPoll.Success, server)
    assert dest.committed == {"r1": 7}


@pytest.mark.parametrize("cached,ok", [(4, True), (8, True), (3, False), (9, False)])
def test_a_reservation_with_cached_rows_ships_only_the_rest(world, monkeypatch, cached, ok):
    """DecodeReservation.cached_len (the decode side's prefix cache): whole pages below the prompt's
    length are not sent; anything else is refused on both sides, before the prefill runs."""
    server, client, dest, source = world
    reserve = dest.reserve

    def reserve_cached(room, pages, prompt_len):
        r = reserve(room, pages, prompt_len)
        dest.rooms[room]["expected"] = (prompt_len - cached) * 2  # 2 layers of kv rows per position
        return dataclasses.replace(r, cached_len=cached)

    monkeypatch.setattr(dest, "reserve", reserve_cached)
    _, p, d = reserved(world)
    outcome = p.run()
    if ok:
        until(lambda: d.poll(client, 5) is KVPoll.Success, server)
        assert dest.rooms == {} and dest.committed == {"r1": 7}
    else:
        assert "cached_len" in outcome.reason and not source.held
        until(lambda: d.poll(client, 5) is KVPoll.Failed, server)
        assert "cached_len" in d.s.reason
