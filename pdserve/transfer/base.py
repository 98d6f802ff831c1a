"""The KVSender / KVReceiver protocol: one polled state machine per side of one room (request).

    Bootstrapping --> WaitingForInput --> Transferring --> Success
          \\                 \\                 \\
           +-----------------+-----------------+--> Failed   (from any non-terminal state)

Sender: Bootstrapping until the decode reservation arrives (bootstrap timeout), WaitingForInput
until the prefill is done and sending starts, Transferring while data frames go out, Success once
the aux message (TransferDone) was sent last. Receiver: Bootstrapping until its reservation was
offered, WaitingForInput until the first data frame, Transferring until the aux data arrived and
checked out (Success) -- or the transfer timeout passed (Failed).

Invariants (DESIGN.md 3.7-3.8): Failed never reverts and keeps its first reason; Success only
from Transferring and is final; an illegal transition raises (it is a bug, not a peer's fault).
Backends call `fail()` for every peer-caused problem, so a bad peer fails one room, never the process.
"""

from __future__ import annotations

import enum
import zlib
from typing import Protocol


class KVPoll(enum.Enum):
    Bootstrapping = "bootstrapping"
    WaitingForInput = "waiting_for_input"
    Transferring = "transferring"
    Success = "success"
    Failed = "failed"


TERMINAL = (KVPoll.Success, KVPoll.Failed)
_NEXT = {
    KVPoll.Bootstrapping: KVPoll.WaitingForInput,
    KVPoll.WaitingForInput: KVPoll.Transferring,
    KVPoll.Transferring: KVPoll.Success,
}


class IllegalTransition(RuntimeError):
    pass


class TransferState:
    """The checked state of one side of one room."""

    def __init__(self, room: str):
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.reason: str | None = None

    def advance(self, to: KVPoll) -> None:
        """Moves one step forward along the happy path; anything else raises."""
        if to is KVPoll.Failed:
            raise IllegalTransition("use fail(reason) to fail a transfer")
        if _NEXT.get(self.state) is not to:
            raise IllegalTransition(f"room {self.room}: {self.state.name} -> {to.name} is not allowed")
        self.state = to

    def fail(self, reason: str) -> bool:
        """Fails a live transfer; returns False (and changes nothing) when it already ended, so
        a second failure or a late abort never rewrites the first outcome."""
        if self.state in TERMINAL:
            return False
        self.state, self.reason = KVPoll.Failed, reason
        return True

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


class KVSender(Protocol):
    def poll(self) -> KVPoll: ...

    @property
    def failure_reason(self) -> str | None: ...

    def abort(self, reason: str = "aborted by prefill") -> None: ...


class KVReceiver(Protocol):
    def poll(self) -> KVPoll: ...

    @property
    def failure_reason(self) -> str | None: ...

    def abort(self, reason: str = "aborted by decode") -> None: ...


class RoomChecksum:
    """Checksum of what one sender shipped to one receiver for one room, the same on both ends.

    crc32 runs over the payloads of each stream (src_rank, layer, kind) in the order they were sent
    (one ZMQ PUSH socket per destination keeps that order); the streams are then combined sorted by
    key, so the result does not depend on how frames of different streams interleave."""

    def __init__(self):
        self.streams: dict[tuple[int, int, str], int] = {}

    def update(self, src: int, layer: int, kind: str, payload: bytes | memoryview) -> None:
        key = (src, layer, kind)
        self.streams[key] = zlib.crc32(payload, self.streams.get(key, 0))

    def value(self) -> int:
        crc = 0
        for (src, layer, kind), c in sorted(self.streams.items()):
            crc = zlib.crc32(f"{src}/{layer}/{kind}/{c};".encode(), crc)
        return crc
