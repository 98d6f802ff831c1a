"""In-process transfer backend for unit tests of the state machine (no sockets, no torch).

A `LoopbackBus` (a shared dict, room -> `_Room`) stands in for both the side channel and the data
path. The receiver opens a room and posts its DecodeReservation; the sender picks it up, checks
the fingerprint, ships frames, and posts TransferDone last. Every room opened gets a new ticket;
the sender keeps the ticket of the reservation it answered, and the bus drops anything posted with
a stale ticket or to a closed room -- so a late completion for an aborted (even a reused) room is
ignored, never delivered (docs/design.md invariant 8).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from .base import KVPoll, RoomChecksum, TransferState
from .messages import DecodeReservation, Fingerprint, IncompatiblePeer, TransferDone, TransferFailed

_tickets = itertools.count(1)
Frame = tuple[int, int, str, bytes]  # (dst_rank, layer, kind, payload)


@dataclass
class _Room:
    reservation: DecodeReservation
    ticket: int = field(default_factory=lambda: next(_tickets))
    frames: list[Frame] = field(default_factory=list)
    done: TransferDone | None = None
    failed: TransferFailed | None = None


class LoopbackBus:
    def __init__(self):
        self.rooms: dict[str, _Room] = {}

    def open(self, reservation: DecodeReservation) -> _Room:
        room = self.rooms[reservation.room] = _Room(reservation)  # replaces any old one: new ticket
        return room

    def _live(self, room: str, ticket: int) -> _Room | None:
        r = self.rooms.get(room)
        return r if r is not None and r.ticket == ticket and r.failed is None else None

    def deliver(self, room: str, ticket: int, frame: Frame) -> bool:
        r = self._live(room, ticket)
        if r is not None and r.done is None:
            r.frames.append(frame)
        return r is not None

    def complete(self, room: str, ticket: int, done: TransferDone) -> bool:
        r = self._live(room, ticket)
        if r is not None:
            r.done = done
        return r is not None

    def fail(self, room: str, ticket: int, reason: str) -> None:
        r = self.rooms.get(room)
        if r is not None and r.ticket == ticket and r.failed is None:
            r.failed = TransferFailed(room, reason)

    def close(self, room: str, ticket: int) -> None:
        if room in self.rooms and self.rooms[room].ticket == ticket:
            del self.rooms[room]


class _End:
    """What both ends share: their state holder `s`, the bus and the room's ticket (once known)."""

    s: TransferState
    bus: "LoopbackBus"
    ticket: int | None

    @property
    def failure_reason(self) -> str | None:
        return self.s.reason

    def _fail(self, reason: str) -> None:
        if self.s.fail(reason) and self.ticket is not None:
            self.bus.fail(self.s.room, self.ticket, reason)  # a tombstone that tells the peer why


class LoopbackReceiver(_End):
    def __init__(
        self,
        bus: LoopbackBus,
        reservation: DecodeReservation,
        transfer_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.bus, self.reservation, self.clock = bus, reservation, clock
        self.s = TransferState(reservation.room)
        self.ticket = bus.open(reservation).ticket
        self.s.advance(KVPoll.WaitingForInput)  # the reservation is offered
        self.deadline = clock() + transfer_timeout_s
        self.frames: list[Frame] = []
        self.first_token: int | None = None

    def poll(self) -> KVPoll:
        if self.s.done:
            return self.s.state
        r = self.bus.rooms.get(self.s.room)
        if r is None or r.ticket != self.ticket:
            self._fail("room state lost")
        elif r.failed is not None:
            self.s.fail(f"sender failed: {r.failed.reason}")
            self.bus.close(self.s.room, self.ticket)  # the side that observes a failure removes the room
        else:
            if r.frames and self.s.state is KVPoll.WaitingForInput:
                self.s.advance(KVPoll.Transferring)
            if r.done is not None:
                self._finish(r)
            elif self.clock() > self.deadline:
                self._fail(f"transfer timeout: data incomplete for room {self.s.room}")
        return self.s.state

    def _finish(self, r: _Room) -> None:
        try:
            self.reservation.fingerprint.check_compatible(r.done.fingerprint)
        except IncompatiblePeer as e:
            return self._fail(f"aux data: {e}")
        sums: dict[int, RoomChecksum] = {}
        for dst, layer, kind, payload in r.frames:
            sums.setdefault(dst, RoomChecksum()).update(0, layer, kind, payload)
        got = {dst: c.value() for dst, c in sums.items()}
        if got != r.done.checksums:
            return self._fail(
                f"checksum mismatch for room {self.s.room}: received {got}, sender sent {r.done.checksums}"
            )
        if self.s.state is KVPoll.WaitingForInput:
            self.s.advance(KVPoll.Transferring)  # an empty transfer still passes through Transferring
        self.frames, self.first_token = list(r.frames), r.done.first_token
        self.s.advance(KVPoll.Success)
        self.bus.close(self.s.room, self.ticket)

    def abort(self, reason: str = "aborted by decode") -> None:
        self._fail(reason)


class LoopbackSender(_End):
    def __init__(
        self,
        bus: LoopbackBus,
        room: str,
        fingerprint: Fingerprint,
        bootstrap_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.bus, self.fingerprint, self.clock = bus, fingerprint, clock
        self.s = TransferState(room)
        self.deadline = clock() + bootstrap_timeout_s
        self.ticket: int | None = None
        self.reservation: DecodeReservation | None = None

    def poll(self) -> KVPoll:
        if self.s.done:
            return self.s.state
        r = self.bus.rooms.get(self.s.room)
        if self.ticket is None:
            if r is not None and r.failed is None:
                self._bootstrap(r)
            elif self.clock() > self.deadline:
                self._fail(f"bootstrap timeout: no decode reservation for room {self.s.room}")
        elif r is None or r.ticket != self.ticket:
            self.s.fail("room closed or reused by decode")
        elif r.failed is not None:
            self.s.fail(f"receiver gave up: {r.failed.reason}")
            self.bus.close(self.s.room, self.ticket)
        return self.s.state

    def _bootstrap(self, r: _Room) -> None:
        self.ticket, self.reservation = r.ticket, r.reservation
        try:
            self.fingerprint.check_compatible(r.reservation.fingerprint)
        except IncompatiblePeer as e:
            return self._fail(str(e))
        self.s.advance(KVPoll.WaitingForInput)

    def send(self, frames: list[Frame]) -> None:
        """Ships the data frames (the sender's whole share). A dropped frame fails the room."""
        if self.poll() is not KVPoll.WaitingForInput:
            raise RuntimeError(f"room {self.s.room}: cannot send in state {self.s.state.name}")
        self.s.advance(KVPoll.Transferring)
        self.sums: dict[int, RoomChecksum] = {}
        for dst, layer, kind, payload in frames:
            self.sums.setdefault(dst, RoomChecksum()).update(0, layer, kind, payload)
            if not self.bus.deliver(self.s.room, self.ticket, (dst, layer, kind, payload)):
                self.s.fail("room closed by decode while sending")
                return

    def finish(self, first_token: int) -> bool:
        """Posts the aux data last; False (and Failed) when the room is gone or was reused."""
        if self.s.done:
            return False
        done = TransferDone(
            self.s.room, first_token, {d: c.value() for d, c in self.sums.items()}, self.fingerprint
        )
        if not self.bus.complete(self.s.room, self.ticket, done):
            self.s.fail("room closed by decode before completion")
            return False
        self.s.advance(KVPoll.Success)
        return True

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._fail(reason)
