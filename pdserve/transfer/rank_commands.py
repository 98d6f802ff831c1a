"""The rank command set of a KV hand-off, shared by both data paths (transfer/tcp.py, transfer/nixl.py).

A server's main process sends these to its ranks (runtime/launcher.RankGroup.call); the rank's
receiver (decode) or sender (prefill) answers. Replies cross the rank pipe as plain dicts (what a
rank can always pickle); the hand-off state machines read them through the typed views below
(`RoomStatus`, `merge_checksums`), never by key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .base import RoomChecksum
from .plan import Segment, Transfer
from .room_rows import RoomSlots, RoomStatus


@dataclass(frozen=True)
class ExpectCmd:
    """Decode ranks: accept rows for `room`; expected[dst_rank][src_rank] = rows (each rank takes its own).
    src_rank ANY_SRC counts rows from every source: the decode side alone knows each rank's total
    (every stored row arrives exactly once), not how the prefill spreads the sending."""

    room: str
    ticket: bytes
    expected: dict[int, dict[int, int]]
    slots: RoomSlots  # the room's pages: rows anywhere else fail the room (transfer/room_rows.py)


@dataclass(frozen=True)
class StageCmd:
    """Decode ranks, at reservation time: get ready to receive `room`; rows[dst_rank] = {kind: rows}
    this rank will store. Reply: a `StageReply`. TCP's
    endpoint is the rank's socket; NIXL's also names a receive region reserved for this room.
    `expect`: the room's ExpectCmd, applied in the same round trip once the stage succeeded."""

    room: str
    ticket: bytes
    rows: dict[int, dict[str, int]]
    expect: ExpectCmd | None = None


@dataclass(frozen=True)
class TransferStatusCmd:
    """Decode ranks: the receiver's view of `room` (rows, checksum, completion) and its counters.
    Reply: a `ReceiverStatus`."""

    room: str


@dataclass(frozen=True)
class SenderStatusCmd:
    """Prefill ranks: the sender's counters (what a send still holds after it returned). Reply: a
    `SenderStatus`."""


@dataclass(frozen=True)
class ForgetCmd:
    """Drops the room. quiesced: the caller knows no sender will write for it any more (every
    prefill rank's SendCmd returned), so a NIXL receive region is reusable at once; otherwise it is
    quarantined (transfer/nixl.py). Reply: a `ForgetReply`."""

    room: str
    quiesced: bool = False


@dataclass(frozen=True)
class SendCmd:
    """Prefill ranks: send the transfers of `plan` whose src_rank is this rank."""

    room: str
    ticket: bytes
    plan: list[Transfer]
    endpoints: dict[int, str]  # decode rank -> "tcp://host:port" (or a NIXL endpoint)
    send_timeout_ms: int = 10_000  # a destination that accepts nothing for this long is dead for this room


@dataclass(frozen=True)
class StreamedSend:
    """A hand-off sent while the prefill computes (the prefill's rank command carries it): the
    rows of each segment leave as soon as they exist -- a segment the prefix cache holds before the
    first chunk, a chunk's segment layer by layer as each layer stores it -- and the reply is
    SendCmd's (transfer/plan.py plan_stream makes the plan and the segments)."""

    send: SendCmd  # its plan is every segment's transfers, in segment order
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ListenerStatusCmd:
    """Decode ranks: whether the receiver thread lives (frames.Liveness). Reply: a `ListenerStatus`."""


TRANSFER_CMDS = (StageCmd, ExpectCmd, TransferStatusCmd, ForgetCmd, ListenerStatusCmd)


class Receiver(Protocol):
    """A decode rank's data-path receiver (transfer/tcp.py TcpReceiver, transfer/nixl.py NixlReceiver)."""

    lock: object  # guards the room table, shared with the receiving thread
    live: object  # frames.Liveness of the receiving thread
    rooms: dict  # room -> what the receiver knows of it (its .status() is a RoomStatus)
    frames: int  # frames / notified chunks stored (every room's)
    dropped: int  # frames / notifications for rooms not expected (late or stale)
    unauthenticated: int
    bad_frames: int

    def stage(self, cmd: StageCmd) -> StageReply: ...

    def expect(self, cmd: ExpectCmd) -> None: ...

    def forget(self, cmd: ForgetCmd) -> ForgetReply: ...

    def counters(self) -> dict:
        """The data path's own idle counters (staging, quarantine, registrations), for status replies."""
        ...


def receive_command(receiver: Receiver, cmd):
    """A decode rank's answer to one TRANSFER_CMDS command, the same for both data paths: a StageCmd
    that carries the room's ExpectCmd applies it once the stage succeeded (one round trip)."""
    with receiver.lock:
        if isinstance(cmd, StageCmd):
            reply = receiver.stage(cmd)
            if reply.error is None and cmd.expect is not None:
                receiver.expect(cmd.expect)
            return reply
        if isinstance(cmd, ExpectCmd):
            return receiver.expect(cmd)
        if isinstance(cmd, ForgetCmd):
            return receiver.forget(cmd)
        if isinstance(cmd, TransferStatusCmd):
            r = receiver.rooms.get(cmd.room)
            counters = {
                "open_rooms": len(receiver.rooms),
                "stored_frames": receiver.frames,
                "dropped": receiver.dropped,
                "unauthenticated": receiver.unauthenticated,
                "bad_frames": receiver.bad_frames,
                **receiver.counters(),
            }
            return ReceiverStatus(counters, r.status() if r else RoomStatus(False))
    if isinstance(cmd, ListenerStatusCmd):
        return receiver.live.status()
    raise TypeError(f"unknown transfer command {type(cmd).__name__}")


@dataclass(frozen=True)
class StageReply:
    """A decode rank's answer to StageCmd: where the room's senders write (TCP: the rank's socket;
    NIXL: an encoded endpoint naming the room's region or the pool), or why it cannot receive it."""

    endpoint: str | None
    error: str | None = None


@dataclass(frozen=True)
class ForgetReply:
    """A decode rank's answer to ForgetCmd: how long the room's pages must stay unused (NIXL WRITEs
    that may still land in the pool; 0: at once)."""

    hold_s: float = 0.0


@dataclass(frozen=True)
class SendReply:
    """A prefill rank's answer to SendCmd (and a streamed send's close): per decode rank, the
    checksum streams of the rows it sent (the receivers compute the same), or why it stopped."""

    sums: dict[int, dict] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class ReceiverStatus:
    """A decode rank's answer to TransferStatusCmd: its receiver's counters (open rooms, frames
    stored, dropped, unauthenticated, malformed; the data path's own: staging, quarantine,
    registrations) and its view of the room."""

    counters: dict[str, int | float | None]
    room: RoomStatus


@dataclass(frozen=True)
class SenderStatus:
    """A prefill rank's answer to SenderStatusCmd: what its sender holds after a send returned (peers,
    transfer handles, staging, registrations: transfer/tcp.py, nixl_send.py) and the clock of its
    last send (last_send_began / last_send_ended, time.monotonic)."""

    counters: dict[str, int | float | None]


class SendError(RuntimeError):
    """A prefill rank could not deliver its share of a room (the rank itself is fine)."""


def merge_checksums(replies: list[SendReply]) -> dict[int, int]:
    """SendCmd replies -> per decode rank, one checksum over every prefill rank's streams (what the
    receiver computes); SendError if any rank failed to send."""
    errors = [f"prefill rank {rank}: {r.error}" for rank, r in enumerate(replies) if r.error]
    if errors:
        raise SendError("; ".join(errors))
    merged: dict[int, dict] = {}
    for reply in replies:
        for dst, streams in reply.sums.items():
            merged.setdefault(dst, {}).update(streams)
    return {dst: RoomChecksum(streams).value() for dst, streams in merged.items()}
