"""The decode side of a KV hand-off: one state machine per room, the one the decode server runs.

Polled (never blocking) by the thread that owns the decode engine, through `DecodeRooms`:

    Bootstrapping    queued for pages (KVDestination.submit); once admitted, every rank is staged
                     and expects its row total (one rank round trip), the DecodeReservation goes to
                     the prefill's side channel, and the transfer deadline starts
    WaitingForInput  waiting for the prefill's outcome (TransferDone is sent after every data frame);
                     meanwhile the prefill's heartbeats (transfer/side_channel.py) must keep coming,
                     or the room fails early (a dead prefill)
    Transferring     TransferDone came: the ranks are asked for the room's rows until every row is
                     in; the same answer is verified (room and layout echo, checksums) -- the ranks
                     are asked once per poll, never twice for one answer
    Success          the ranks forget the room (quiesced), KVDestination.commit: the request runs
    Failed           from any state: TransferFailed from the prefill, a rank's error, a bad echo or
                     checksum, the deadline, a silent prefill, an abort (client gone). The prefill is
                     told (TransferFailed) when it was reserved, the ranks forget the room --
                     quiesced only if the prefill answered, i.e. every sender returned -- and the
                     request is released with the pages held for the quarantine the ranks name
                     (late one-sided WRITEs may still land in them).
Every transition is in this class, and every end goes through `_end`, the one place that releases.
"""

from __future__ import annotations

import time
from typing import Callable

from .base import KVPoll, TransferState
from .decode_client import DecodeClient
from .interfaces import Admitted, KVDestination
from .messages import DecodeReservation, TransferDone, TransferFailed
from .rank_commands import RoomStatus


class RoomFailure(Exception):
    """A reason to fail the room (peer-caused or a timeout); anything else raised is unexpected."""


class DecodeRoom:
    def __init__(
        self,
        dest: KVDestination,
        room: str,
        prompt_len: int,
        bootstrap: str,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.dest, self.room, self.prompt_len, self.bootstrap = dest, room, prompt_len, bootstrap
        self.timeout_s, self.clock = timeout_s, clock
        self.s = TransferState(room)
        self.reservation: DecodeReservation | None = None
        self.sent = self.deadline = 0.0  # when the reservation went out; when the rows must be in
        self.nbytes = 0  # payload the hand-off carries
        self.done: TransferDone | None = None
        self.request: Admitted | None = None  # after Success

    @property
    def state(self) -> KVPoll:
        return self.s.state

    def poll(self, client: DecodeClient, heartbeat_timeout_s: float) -> KVPoll:
        """One look at the room; every failure ends it (an unexpected error is re-raised after)."""
        if self.s.done:
            return self.s.state
        try:
            if self.s.state is KVPoll.Bootstrapping:
                self._reserve(client)
            else:
                self._progress(client, heartbeat_timeout_s)
        except RoomFailure as e:
            self._end(client, str(e), quiesced=self._quiesced(client))
        except Exception as e:  # a rank call failed: the caller decides whether the instance goes on
            self._end(client, f"{type(e).__name__}: {e}", quiesced=False, guarded=True)
            raise
        return self.s.state

    def _quiesced(self, client: DecodeClient) -> bool:
        """The prefill answered after every rank's sends returned: no WRITE for the room can come."""
        outcome = client.outcome(self.room)
        return isinstance(outcome, TransferDone) or (isinstance(outcome, TransferFailed) and outcome.quiesced)

    def abort(self, client: DecodeClient, reason: str = "aborted by the decode instance") -> bool:
        if self.s.done:
            return False
        self._end(client, reason, quiesced=False)
        return True

    def _reserve(self, client: DecodeClient) -> None:
        pages = self.dest.admitted_pages(self.room)
        if pages is None:
            return  # still queued for pages
        try:
            self.reservation = self.dest.reserve(self.room, pages, self.prompt_len)
        except RuntimeError as e:  # a rank could not stage the room
            raise RoomFailure(str(e)) from None
        self.nbytes = self.dest.handoff_bytes(pages, self.prompt_len, self.room)
        client.send(self.reservation)
        self.sent = self.clock()
        self.deadline = self.sent + self.timeout_s
        self.s.advance(KVPoll.WaitingForInput)

    def _progress(self, client: DecodeClient, heartbeat_timeout_s: float) -> None:
        late = self.clock() > self.deadline
        outcome = client.outcome(self.room)
        if isinstance(outcome, TransferFailed):  # also after a TransferDone: a later word wins
            raise RoomFailure(f"prefill failed: {outcome.reason}")
        if self.s.state is KVPoll.WaitingForInput:
            if outcome is None:
                if late:
                    raise RoomFailure(
                        f"transfer timeout after {self.timeout_s} s waiting for the prefill's outcome"
                    )
                silent = client.silent_for(self.bootstrap, self.sent)
                if silent > heartbeat_timeout_s:
                    raise RoomFailure(
                        f"the prefill instance at {self.bootstrap} stopped answering "
                        f"(no heartbeat for {silent:.1f} s)"
                    )
                return
            self.done = outcome
            self.s.advance(KVPoll.Transferring)
        status = self.dest.room_status(self.room)  # asked once per poll, and verified from this answer
        errors = [f"decode rank {r}: {s.error}" for r, s in enumerate(status) if s.error]
        if errors:
            raise RoomFailure("; ".join(errors))
        if not all(s.known for s in status):
            raise RoomFailure("the decode ranks dropped the room")
        if all(s.complete for s in status):
            self._verify(status)
            self._end(client, None, quiesced=True)
        elif late:
            got = ", ".join(f"rank {r}: {s.rows}/{s.expected}" for r, s in enumerate(status))
            raise RoomFailure(f"transfer timeout after {self.timeout_s} s waiting for the rows (rows {got})")

    def _verify(self, status: list[RoomStatus]) -> None:
        """The aux data: room echo, layout echo against the CURRENT fingerprint, checksums."""
        done = self.done
        if done.room != self.room:
            raise RoomFailure(f"aux data for room {done.room}, expected {self.room}")
        try:
            self.dest.fingerprint().check_compatible(done.fingerprint)
        except Exception as e:
            raise RoomFailure(f"aux data: {e}") from None
        for rank, s in enumerate(status):
            sent = done.checksums.get(rank, 0)
            if s.checksum != sent:
                raise RoomFailure(
                    f"checksum mismatch on decode rank {rank}: received {s.checksum:#010x}, sender sent {sent:#010x}"
                )

    def _end(self, client: DecodeClient, failure: str | None, quiesced: bool, guarded: bool = False) -> None:
        """The one exit. Success: the ranks forget the room, the request runs. Failure: the prefill is
        told, the ranks forget the room, the request is released with the quarantine hold."""
        room, reserved = self.room, self.reservation is not None
        if failure is None:
            self.dest.forget(room, True)
            client.forget(room)
            self.s.advance(KVPoll.Success)
            self.request = self.dest.commit(room, self.done.first_token, self.done.more_first)
            return
        self.s.fail(failure)
        hold_s = 0.0
        try:
            if reserved:
                client.send(
                    TransferFailed(room, failure, self.reservation.ticket)
                )  # a prefill working on it stops
                hold_s = self.dest.forget(room, quiesced)
        except Exception:
            if not guarded:
                raise
        finally:
            client.forget(room)
            self.dest.release(room, hold_s)  # hold_s > 0: senders may still WRITE into its pages
