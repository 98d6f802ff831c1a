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
import time
import zlib
from typing import Protocol

import torch

from ..engine.row_sums import row_sums


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
    checksum is taken on both sides of every hand-off, so its speed bounds the hand-off's).

    A receiver whose payloads may land out of their sent order (NIXL WRITEs in flight together) gives
    each its place in the sender's sequence (`order`); payloads of equal order count in the order
    given, so a path that delivers in order passes none."""

    def __init__(self, streams: dict | None = None):
        self._given = dict(streams or {})  # whole streams (a sender's reply, merge_checksums)
        self._parts: dict[tuple[int, int, str], list[tuple[tuple, int, bytes]]] = {}
        self._crcs: dict | None = None  # streams, once computed since the last update

    def update(self, src: int, layer: int, kind: str, rows, order: tuple = ()) -> None:
        """rows: a [n, width] tensor (n whole rows), or a bytes-like payload taken as one row."""
        self.update_digest(src, layer, kind, row_digest(rows), order)

    def update_digest(self, src: int, layer: int, kind: str, digest: bytes, order: tuple = ()) -> None:
        """The same with the rows' digest already taken (`row_digest`, `sums_digest`)."""
        parts = self._parts.setdefault((src, layer, kind), [])
        parts.append((order, len(parts), digest))
        self._crcs = None

    @property
    def streams(self) -> dict[tuple[int, int, str], int]:
        """(src_rank, layer, kind) -> crc32 over its payloads' digests in their sent order."""
        if self._crcs is None:
            self._crcs = dict(self._given)
            for key, parts in self._parts.items():
                crc = 0
                for _, _, digest in sorted(parts, key=lambda p: p[:2]):
                    crc = zlib.crc32(digest, crc)
                self._crcs[key] = crc
        return self._crcs

    def value(self) -> int:
        crc = 0
        for (src, layer, kind), c in sorted(self.streams.items()):
            crc = zlib.crc32(f"{src}/{layer}/{kind}/{c};".encode(), crc)
        return crc


def row_digest(rows) -> bytes:
    """The row sums (engine/row_sums.py) of a [n, width] tensor, or of a bytes-like payload taken as
    one row, as the bytes a checksum stream runs over."""
    if not isinstance(rows, torch.Tensor):
        if not len(rows):
            return bytes(8)  # one empty row: sum 0
        rows = torch.frombuffer(bytearray(rows), dtype=torch.uint8).view(1, -1)
    return sums_digest(row_sums(rows))


def sums_digest(sums: torch.Tensor) -> bytes:
    """Row sums already taken ([n] int64, any device; a pool's, engine/kv_cache.py) as those bytes."""
    return sums.cpu().numpy().tobytes()


class SendClock:
    """When a sender's last send began and returned (time.monotonic()), for its status reply: a
    caller splits a hand-off's time by it (bench/transfer.py's phases, docs/nixl.md)."""

    def __init__(self):
        self.began: float | None = None
        self.ended: float | None = None

    def __enter__(self) -> SendClock:
        self.began, self.ended = time.monotonic(), None
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.monotonic()

    def status(self) -> dict:
        return {"last_send_began": self.began, "last_send_ended": self.ended}
