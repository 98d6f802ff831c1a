"""The prefill side of a KV hand-off: one state machine per room, the one the prefill server runs.

    Bootstrapping    the request is here, its decode reservation is not yet (bootstrap timeout);
                     poll() claims it once it came (a claimed reservation never expires)
    WaitingForInput  the reservation is claimed: the room waits for the prefill ranks (and pages)
    Transferring     run(): fingerprint checked, then either (a streamed source) the prompt
                     prefilled while every rank sends its share of each layer's rows as it stores
                     them (KVSource.prefill_send), or the prompt prefilled, plan_transfer, every
                     rank sends its share; either way every rank returns only when its sends are
                     done or cancelled
    Success          TransferDone (first token, checksums, layout echo) sent LAST
    Failed           from any state: an abort from either side, the bootstrap timeout, a refused
                     fingerprint, a failed prefill or send; the decode side gets TransferFailed
                     when it reserved the room
Every transition is in this class, and every end goes through `_end`, the one place that releases
the source's rows and answers (or forgets) the room on the side channel. `PrefillRooms` is the
instance's table of rooms, with the tombstones of rooms aborted here before their reservation came.
"""

from __future__ import annotations

import time
from typing import Callable

from ..request import SamplingParams
from .base import KVPoll, TransferState
from .interfaces import KVSource
from .messages import DecodeReservation, TransferDone, TransferFailed
from .plan import DecodeSide, plan_transfer
from .rank_commands import SendError
from .side_channel import BootstrapServer

DROPPED_KEEP_S = 600.0  # how long a room aborted here waits for a late reservation to refuse


class PrefillRoom:
    def __init__(
        self,
        source: KVSource,
        server: BootstrapServer,
        room: str,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        bootstrap_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.source, self.server, self.room = source, server, room
        self.prompt_ids, self.params = list(prompt_ids), params or SamplingParams()
        self.bootstrap_timeout_s, self.clock = bootstrap_timeout_s, clock
        self.deadline = clock() + bootstrap_timeout_s
        self.s = TransferState(room)
        self.reservation: DecodeReservation | None = None
        self.result = None  # the source's PrefillResult once prefilled (its prompt logprobs, for echo)
        self.outcome: TransferDone | TransferFailed | None = None

    @property
    def state(self) -> KVPoll:
        return self.s.state

    def poll(self) -> KVPoll:
        """Non-blocking: takes the reservation, or fails the room (decode abort, bootstrap timeout)."""
        room, server = self.room, self.server
        if self.s.done:
            return self.s.state
        if room in server.aborted:
            self._end(TransferFailed(room, f"aborted by decode: {server.aborted[room]}"))
        elif self.s.state is KVPoll.Bootstrapping:
            if (reservation := server.claim(room)) is not None:
                self.reservation = reservation
                self.s.advance(KVPoll.WaitingForInput)
            elif self.clock() > self.deadline:
                self._end(
                    TransferFailed(
                        room,
                        f"bootstrap timeout: no decode reservation for room {room} "
                        f"within {self.bootstrap_timeout_s} s",
                    )
                )
        return self.s.state

    def run(self) -> TransferDone | TransferFailed:
        """WaitingForInput -> Transferring -> Success | Failed: prefill, send, answer. Blocking."""
        if self.poll() is not KVPoll.WaitingForInput:
            return self.outcome or self._end(TransferFailed(self.room, f"not ready ({self.s.state.name})"))
        self.s.advance(KVPoll.Transferring)
        reservation, room, sending = self.reservation, self.room, False
        try:
            fp = self.source.handoff_fingerprint(reservation)
            fp.check_compatible(reservation.fingerprint)
            cached = reservation.cached_len  # rows the decode side holds already (its prefix cache)
            if cached >= len(self.prompt_ids) or cached % reservation.page_size:
                raise _Failed(f"reservation: cached_len {cached} is not whole pages of the prompt")
            decode_side = DecodeSide(
                reservation.tp_size,
                reservation.dcp_size,
                fp.index_mode,
                reservation.page_size,
                reservation.pages,
            )
            if self.source.stream_handoff:  # the rows leave while the prefill computes them
                sending = True
                result, sums = self.source.prefill_send(
                    room,
                    self.prompt_ids,
                    self.params,
                    decode_side,
                    cached,
                    reservation.ticket,
                    reservation.endpoints,
                )
                self._check_aborted()  # it sent everything: the decode side gave the room up meanwhile
            else:
                result = self.source.prefill(room, self.prompt_ids, self.params)
                self._check_aborted()
                plan = plan_transfer(
                    self.source.prefill_side(result.slots), decode_side, len(self.prompt_ids), cached
                )
                sending = True
                sums = self.source.send(room, room, reservation.ticket, plan, reservation.endpoints)
            self.result = result
            first_lp = [] if result.logprob is None else result.logprob.wire()
            more = [[t, [] if lp is None else lp.wire()] for t, lp in result.more_first]
            msg: TransferDone | TransferFailed = TransferDone(
                room, result.token, sums, fp, first_logprob=first_lp, more_first=more
            )
        except _Failed as e:
            msg = TransferFailed(room, str(e))
        except SendError as e:  # every rank returned: what it posted is done or cancelled
            msg = TransferFailed(room, f"SendError: {e}")
        except Exception as e:  # during the send (e.g. a rank died), the other ranks may still write
            msg = TransferFailed(room, f"{type(e).__name__}: {e}", quiesced=not sending)
        return self._end(msg)

    def _check_aborted(self) -> None:
        self.server.drain()
        if self.room in self.server.aborted:
            raise _Failed(f"aborted by decode: {self.server.aborted[self.room]}")

    def abort(self, reason: str = "aborted by the prefill instance") -> bool:
        """Fails a room that has not ended (False when it had)."""
        if self.s.done:
            return False
        self._end(TransferFailed(self.room, reason))
        return True

    def _end(self, msg: TransferDone | TransferFailed) -> TransferDone | TransferFailed:
        """The one exit: rows released, the decode side answered if it reserved (else the room is
        forgotten), the state final."""
        try:
            self.source.release(self.room)
        finally:
            if self.room in self.server.peers:
                self.server.reply(msg)  # the outcome goes LAST: after every rank's sends returned
            else:
                self.server.forget(self.room)
            if isinstance(msg, TransferDone):
                self.s.advance(KVPoll.Success)
            else:
                self.s.fail(msg.reason)
            self.outcome = msg
        return msg


class _Failed(Exception):
    pass


class PrefillRooms:
    """The prefill instance's hand-off rooms (by room id) and the rooms aborted here before their
    reservation came: a reservation that comes later is answered TransferFailed (for DROPPED_KEEP_S;
    its decode side times out by then), so the decode side never waits for nothing."""

    def __init__(
        self, source: KVSource, server: BootstrapServer, clock: Callable[[], float] = time.monotonic
    ):
        self.source, self.server, self.clock = source, server, clock
        self.rooms: dict[str, PrefillRoom] = {}
        self.dropped: dict[str, float] = {}

    def open(
        self, room: str, prompt_ids: list[int], params: SamplingParams | None, bootstrap_timeout_s: float
    ) -> PrefillRoom:
        if room in self.rooms:
            raise ValueError(f"room {room!r} is already in use")
        self.dropped.pop(room, None)
        r = self.rooms[room] = PrefillRoom(
            self.source, self.server, room, prompt_ids, params, bootstrap_timeout_s, self.clock
        )
        return r

    def get(self, room: str) -> PrefillRoom | None:
        return self.rooms.get(room)

    def close(self, room: str) -> None:
        """Removes an ended room from the table."""
        r = self.rooms.get(room)
        if r is not None and r.s.done:
            del self.rooms[room]

    def abort(self, room: str, reason: str = "aborted by the prefill instance") -> bool:
        r = self.rooms.pop(room, None)
        if r is None:
            return False
        if r.state is KVPoll.Bootstrapping:
            self.dropped[room] = self.clock()
        r.abort(reason)
        return True

    def tidy(self) -> None:
        """Takes in reservations and aborts; answers late reservations of rooms aborted here; forgets
        rooms the decode side gave up that have no room here (else they would be kept forever)."""
        self.server.drain()
        now = self.clock()
        for room, since in list(self.dropped.items()):
            if room in self.server.reservations:
                self.server.reply(TransferFailed(room, "aborted by the prefill instance"))
                del self.dropped[room]
            elif now - since > DROPPED_KEEP_S:
                del self.dropped[room]
        for room in list(self.server.aborted):
            if room not in self.rooms:
                self.server.forget(room)
                self.dropped.pop(room, None)
