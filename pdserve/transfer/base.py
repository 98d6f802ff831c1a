"""The KVSender / KVReceiver protocol: one polled state machine per side of one room (request).

    Bootstrapping --> WaitingForInput --> Transferring --> Success
          \\                 \\                 \\
           +-----------------+-----------------+--> Failed   (from any non-terminal state)

Sender: Bootstrapping until the decode reservation arrives (bootstrap timeout), WaitingForInput
until the prefill is done and sending starts, Transferring while data frames go out, Success once
the aux message (TransferDone) was sent last. Receiver: Bootstrapping until its reservation was
offered, WaitingForInput until the first data frame, Transferring until the aux data arrived and
checked out (Success) -- or the transfer timeout passed (Failed).

Invariants (docs/design.md 3.7-3.8): Failed never reverts and keeps its first reason; Success only
from Transferring and is final; an illegal transition raises (it is a bug, not a peer's fault).
Backends call `fail()` for every peer-caused problem, so a bad peer fails one room, never the process.
"""

from __future__ import annotations

import enum
import zlib
from typing import Protocol

import torch


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

    Per stream (src_rank, layer, kind), crc32 runs over the ROW DIGESTS of its payloads in the order
    they were sent (`row_digest`: one wrapping int64 sum per row); the streams are then combined
    sorted by key, so the result does not depend on how chunks of different streams interleave.
    Any changed bit changes its row's sum, and the crc over the ordered row sums catches rows that
    were dropped, repeated or moved -- at ~45 GB/s instead of crc32's ~7 GB/s over every byte (the
    checksum is taken on both sides of every hand-off, so its speed bounds the hand-off's)."""

    def __init__(self):
        self.streams: dict[tuple[int, int, str], int] = {}

    def update(self, src: int, layer: int, kind: str, rows) -> None:
        """rows: a [n, width] tensor (n whole rows), or a bytes-like payload taken as one row."""
        key = (src, layer, kind)
        self.streams[key] = zlib.crc32(row_digest(rows), self.streams.get(key, 0))

    def value(self) -> int:
        crc = 0
        for (src, layer, kind), c in sorted(self.streams.items()):
            crc = zlib.crc32(f"{src}/{layer}/{kind}/{c};".encode(), crc)
        return crc


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def row_digest(rows) -> bytes:
    """Per row, the wrapping int64 sum of its bytes read as words of the widest integer type that
    divides the row's byte size (so the digest depends on the rows only, not on where they sit)."""
    if not isinstance(rows, torch.Tensor):
        if not len(rows):
            return bytes(8)  # one empty row: sum 0
        rows = torch.frombuffer(bytearray(rows), dtype=torch.uint8).view(1, -1)
    b = rows.reshape(len(rows), -1).contiguous().view(torch.uint8)
    if b.numel() == 0:
        return bytes(8 * len(b))
    size, word = next((n, t) for n, t in _WORDS if b.shape[1] % n == 0)
    if b.storage_offset() % size or b.data_ptr() % size:
        b = b.clone()  # a view at an odd offset: word loads need alignment
    # on the rows' device (a GPU sums VRAM rows there), then one copy of the [rows] sums to the host
    return b.view(word).sum(1, dtype=torch.int64).cpu().numpy().tobytes()
