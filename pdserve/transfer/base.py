"""A room's polled state (the one state machine per side: transfer/prefill_room.py, decode_room.py),
the room MAC both sides take over the rows, and the senders' clock.

    Bootstrapping --> WaitingForInput --> Transferring --> Success
          \\                 \\                 \\
           +-----------------+-----------------+--> Failed   (from any non-terminal state)

What each state means on each side is in the two machines' docstrings. Invariants (docs/design.md
3.7-3.8): Failed never reverts and keeps its first reason; Success only from Transferring and is
final; an illegal transition raises (it is a bug, not a peer's fault). The machines call `fail()`
for every peer-caused problem, so a bad peer fails one room, never the process.
"""

from __future__ import annotations

import enum
import hashlib
import time

import torch

from .row_mac import fold, int63, row_macs


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


class RoomChecksum:
    """The room MAC: what one sender shipped to one receiver for one room, keyed by the cluster frame
    key and the same on both ends (docs/design.md invariant 11).

    Per stream (src_rank, layer, kind), a keyed MAC runs over the keyed ROW HASHES of its payloads in
    the order they were sent (`transfer/row_mac.py`: two Toeplitz NH hashes per row under a secret
    key, taken on the rows' device and kept there; `fold`: NH again over blocks of them, then a keyed
    BLAKE2b over the row count and the block hashes); the streams are then combined sorted by key, so
    the result does not depend on how chunks of different streams interleave, nor on how a stream was
    cut into frames or chunks. A changed row changes its hashes (but with chance <= 2^-64), and the
    ordered MAC over them catches rows that were dropped, repeated or moved; without the key nobody
    can make forged rows keep it, which the CRC of wrapping int64 row sums it replaced did not give
    (+d on one word and -d on another kept a row's sum).

    A receiver whose payloads may land out of their sent order (NIXL WRITEs in flight together) gives
    each its place in the sender's sequence (`order`); payloads of equal order count in the order
    given, so a path that delivers in order passes none. `streams` of a sender's reply are keyed
    MACs already: combining them (`value`, merge_checksums) needs no key."""

    def __init__(self, streams: dict | None = None, key: bytes | None = None):
        self.key = key
        self._given = dict(streams or {})  # whole streams (a sender's reply, merge_checksums)
        self._parts: dict[tuple[int, int, str], list[tuple[tuple, int, torch.Tensor]]] = {}
        self._macs: dict | None = None  # streams, once computed since the last update

    def update(self, src: int, layer: int, kind: str, rows, order: tuple = ()) -> None:
        """rows: a [n, width] tensor (n whole rows), or a bytes-like payload taken as one row."""
        if self.key is None:
            raise ValueError("a RoomChecksum takes rows only with the frame key")
        if not isinstance(rows, torch.Tensor):
            rows = torch.frombuffer(bytearray(rows), dtype=torch.uint8).view(1, -1) if len(rows) else None
        self.add_hashes(src, layer, kind, None if rows is None else row_macs(self.key, rows), order)

    def add_hashes(
        self, src: int, layer: int, kind: str, hashes: torch.Tensor | None, order: tuple = ()
    ) -> None:
        """`update` with the rows' hashes already taken ([n, LANES], row_mac.row_macs under this key:
        a pool that keeps them, KVPool.keep_row_hashes); they stay on their device until `streams`."""
        parts = self._parts.setdefault((src, layer, kind), [])
        if hashes is not None and len(hashes):
            parts.append((order, len(parts), hashes))
        self._macs = None

    @property
    def streams(self) -> dict[tuple[int, int, str], int]:
        """(src_rank, layer, kind) -> keyed MAC (63 bits) of its row hashes in their sent order."""
        if self._macs is None:
            self._macs = dict(self._given)
            for key, parts in self._parts.items():
                self._macs[key] = fold(self.key, [h for _, _, h in sorted(parts, key=lambda p: p[:2])])
        return self._macs

    def value(self) -> int:
        """0 for nothing sent (a decode rank a plan gives no rows: TransferDone names no value)."""
        if not self.streams:
            return 0
        h = hashlib.blake2b(digest_size=8, person=b"pdserve room")
        for (src, layer, kind), c in sorted(self.streams.items()):
            h.update(f"{src}/{layer}/{kind}/{c};".encode())
        return int63(h.digest())


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
