"""Runs the production hand-off machines (transfer/prefill_room.py, transfer/decode_room.py) between
a prefill instance and a decode engine in one test thread, over the real side channel
(BootstrapService: its own thread, heartbeats) and the ranks' real data path (TCP or NIXL).

`Driver.hand_off` steps both machines the way the two servers' threads do: the decode room is
submitted, admitted and reserved (DecodeRooms, as the decode loop thread polls it), the prefill
room claims the reservation and runs (as the prefill worker does), and the decode room is polled
until it ends. A test injects a fault by wrapping the KVSource (`FaultySource`) or by stepping the
machines itself between those calls.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from pdserve.decode_server.destination import DriverDestination
from pdserve.decode_server.handoff_rooms import DecodeRooms
from pdserve.decode_server.scheduler import DecodeRequest
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.request import SamplingParams
from pdserve.runtime.faults import ArmFaultCmd
from pdserve.transfer.base import KVPoll
from pdserve.transfer.decode_room import DecodeRoom
from pdserve.transfer.prefill_room import PrefillRoom, PrefillRooms
from pdserve.transfer.side_channel import BootstrapService

_rooms = itertools.count()


class TransferError(RuntimeError):
    """The hand-off of `room` failed (or was aborted); both sides released it."""

    def __init__(self, room: str, reason: str):
        super().__init__(f"room {room}: {reason}")
        self.room, self.reason = room, reason


@dataclasses.dataclass
class FaultySource:
    """A KVSource that delegates to a prefill instance, with one fault injected at send time."""

    inner: PrefillInstance
    corrupt: bool = False  # flip one payload byte after the sender checksummed it (ArmFaultCmd)
    skip_send: bool = False  # the rows never come
    dtype: str | None = None  # claim this model dtype (a refused fingerprint)
    before_send: Callable[[str], None] | None = None  # e.g. the decode side drops the room
    after_send: Callable[[str], None] | None = None  # e.g. the prefill fails after sending
    # streamed (prefill_send): before_send runs before the prefill, after_send after it
    stream_handoff: bool = False

    def handoff_fingerprint(self, reservation):
        fp = self.inner.handoff_fingerprint(reservation)
        return dataclasses.replace(fp, model_dtype=self.dtype) if self.dtype else fp

    def prefill(self, request_id, token_ids, params=None):
        return self.inner.prefill(request_id, token_ids, params)

    def prefill_side(self, slots):
        return self.inner.prefill_side(slots)

    def send(self, request_id, room, ticket, plan, endpoints):
        if self.before_send:
            self.before_send(room)
        sums = {}
        if not self.skip_send:
            self._arm(room)
            sums = self.inner.send(request_id, room, ticket, plan, endpoints)
        if self.after_send:
            self.after_send(room)
        return sums

    def prefill_send(self, room, token_ids, params, decode, start, ticket, endpoints):
        if self.before_send:
            self.before_send(room)
        if self.skip_send:
            raise AssertionError("skip_send needs the unstreamed path (stream_handoff=False)")
        self._arm(room)
        got = self.inner.prefill_send(room, token_ids, params, decode, start, ticket, endpoints)
        if self.after_send:
            self.after_send(room)
        return got

    def _arm(self, room: str) -> None:
        if self.corrupt:  # every rank: each that sends flips a byte of its first payload of the room
            self.inner.ranks.call(ArmFaultCmd("corrupt", room))

    def release(self, request_id):
        self.inner.release(request_id)


class Driver:
    def __init__(self, prefill: PrefillInstance, decode: DecodeStepDriver, heartbeat_timeout_s: float = 30.0):
        self.prefill, self.decode = prefill, decode
        self.server = BootstrapService()
        self.events: dict[str, list] = {}
        self.rooms = DecodeRooms(
            DriverDestination(decode),
            lambda room, ev: self.events.setdefault(room, []).append(ev),
            heartbeat_timeout_s=heartbeat_timeout_s,
        )
        self.prefill_rooms = PrefillRooms(prefill, self.server)

    def close(self) -> None:
        self.rooms.close()
        self.server.close()

    # ---- the machines, stepped as the servers' threads step them ---------------------------------
    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        room: str,
        timeout_s: float,
        bootstrap: str | None = None,
    ) -> DecodeRoom:
        r = self.rooms.submit(
            room, len(ids), params, bootstrap or self.server.endpoint, timeout_s, prompt_ids=list(ids)
        )
        self.decode.admit()  # the engine step's admit (only hand-offs are queued in these tests)
        self.rooms.reserve_admitted()
        return r

    def claim(self, room: PrefillRoom, decode_room: DecodeRoom, wait_s: float = 10.0) -> KVPoll:
        """Polls both sides until the prefill room has its reservation (or either room ended). A decode
        room still queued for pages (held by a quarantine) is admitted as soon as they are free."""
        deadline = time.monotonic() + wait_s
        live = (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
        while room.poll() is KVPoll.Bootstrapping and decode_room.state in live:
            assert time.monotonic() < deadline, "the reservation never reached the prefill"
            if decode_room.state is KVPoll.Bootstrapping:
                self.decode.admit()
            self.rooms.poll()  # the decode client drains: Welcome, then the held reservation goes out
            self.server.drain(2)
        return room.state

    def finish(self, decode_room: DecodeRoom, wait_s: float = 60.0) -> DecodeRequest:
        """Polls the decode side until the room ended; its request, or TransferError."""
        deadline = time.monotonic() + wait_s
        while decode_room.room in self.rooms.rooms and self.rooms.rooms[decode_room.room] is decode_room:
            assert time.monotonic() < deadline, f"room {decode_room.room} never ended"
            if decode_room.state is KVPoll.Bootstrapping:
                self.decode.admit()  # its pages were held by a quarantine
            self.rooms.poll()
            self.prefill_rooms.tidy()  # as the prefill worker does: late reservations of aborted rooms
            time.sleep(0.001)
        if decode_room.state is not KVPoll.Success:
            raise TransferError(decode_room.room, decode_room.s.reason or "aborted")
        return decode_room.request

    def hand_off(
        self, ids: list[int], params=None, *, room=None, timeout_s=30.0, source=None
    ) -> DecodeRequest:
        """One request's hand-off through both machines; the decode request (running, or finished
        when its first token ends it), or TransferError once both sides released the room."""
        room, params = room or f"room-{next(_rooms)}", params or SamplingParams()
        d = self.submit(ids, params, room, timeout_s)
        p = self.prefill_rooms.open(room, ids, params, bootstrap_timeout_s=timeout_s)
        if source is not None:
            p.source = source
        if self.claim(p, d) is KVPoll.WaitingForInput:
            p.run()
        elif not p.s.done:  # the decode room ended before its reservation went out
            self.prefill_rooms.abort(room, "the decode room ended")
        self.prefill_rooms.close(room)
        return self.finish(d)


def hand_off(prefill, decode, ids, params=None, room=None, timeout_s=30.0, source=None) -> DecodeRequest:
    """A one-off Driver: one hand-off, then its side channel closes."""
    driver = Driver(prefill, decode)
    try:
        return driver.hand_off(ids, params, room=room, timeout_s=timeout_s, source=source)
    finally:
        driver.close()
