"""The decode half of KV hand-offs, driven by the engine thread without ever blocking it.

A request submitted with a `bootstrap` endpoint (a prefill instance's side channel) gets its cache
by hand-off instead of a local prefill. Per room, polled once per engine-loop iteration:

    queued           submit_remote(): waits for pages for prompt + max_tokens, like any request
    reserved         admitted (pages held): every rank expects its row total for the room, then the
                     DecodeReservation goes to the prefill; the transfer deadline starts
    transferring     the prefill's outcome came (TransferDone, sent after every data frame) and
                     the rows are counted in by the rank threads; meanwhile the prefill's heartbeats
                     (transfer/side_channel.py) must keep coming, or the room fails early
    running          every row arrived, checksums and the layout echo verified: kv_ready(), the
                     first token (the prefill's) goes to the client, the request joins the batch
    failed           TransferFailed from the prefill, a rank's error, a bad checksum, or the
                     deadline: the room is forgotten on every rank, the pages freed, the prefill told
                     (TransferFailed), the client gets one error event. Other requests go on.
An abort (client gone) releases the room the same way. The engine thread owns every DecodeClient
(ZMQ sockets are single-threaded). Clients are cached per prefill bootstrap endpoint, share one ZMQ
context (a client costs a socket, not I/O threads), and are bounded: one with no open room is
closed after `client_idle_s`, and beyond `max_clients` the least recently used idle one goes first
(so a stream of distinct -- even bogus -- endpoints cannot exhaust threads or file descriptors).

Health (docs/design.md invariant 11): every LISTENER_CHECK_S the engine thread asks the ranks whether
their data-path receiver threads live (DecodeInstance.listener_problem); `unhealthy()` returns the
last answer for /health without touching the ranks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import zmq

from ..engine.launcher import RankError
from ..engine.request import SamplingParams
from ..transfer.frames import DEV_FRAME_KEY
from ..transfer.handoff import HandoffFailure, verify_done
from ..transfer.messages import DecodeReservation, TransferDone, TransferFailed
from ..transfer.side_channel import DecodeClient
from ..transfer.two_sided import poll_room
from .engine import DecodeEngine

Emit = Callable[[str, tuple[str, object]], None]  # (request_id, event) -> delivered to its listener
MAX_CLIENTS = 64
CLIENT_IDLE_S = 60.0
LISTENER_CHECK_S = 2.0


@dataclass
class _Room:
    prompt_len: int
    bootstrap: str
    timeout_s: float
    reservation: DecodeReservation | None = None
    sent: float = 0.0  # when the reservation went out
    nbytes: int = 0  # payload the hand-off carries
    deadline: float = 0.0


class RemoteRooms:
    def __init__(
        self,
        engine: DecodeEngine,
        emit: Emit,
        transfer_timeout_s: float = 30.0,
        heartbeat_timeout_s: float = 5.0,
        frame_key: bytes = DEV_FRAME_KEY,
        max_clients: int = MAX_CLIENTS,
        client_idle_s: float = CLIENT_IDLE_S,
    ):
        self.engine, self.emit, self.transfer_timeout_s = engine, emit, transfer_timeout_s
        self.heartbeat_timeout_s, self.frame_key = heartbeat_timeout_s, frame_key
        self.max_clients, self.client_idle_s = max_clients, client_idle_s
        self.rooms: dict[str, _Room] = {}
        self.ctx = zmq.Context()  # shared by every client
        self.clients: OrderedDict[str, DecodeClient] = OrderedDict()  # least recently used first
        self.clients_closed = 0
        self.listener_error: str | None = None  # a rank's receiver thread is dead or wedged (for /health)
        self._next_check = 0.0
        self.completed = self.failed = 0
        self.bytes_received, self.transfer_seconds = (
            0,
            0.0,
        )  # over completed hand-offs (reservation -> verified)

    def submit(
        self,
        room: str,
        prompt_len: int,
        params: SamplingParams,
        bootstrap: str,
        timeout_s: float | None = None,
    ) -> None:
        """Queues the request; ValueError when it can never fit (nothing is kept then)."""
        if room in self.rooms:
            raise ValueError(f"room {room!r} is already in use")
        self.engine.submit_remote(prompt_len, params, request_id=room)
        self.rooms[room] = _Room(prompt_len, bootstrap, timeout_s or self.transfer_timeout_s)

    @property
    def pending(self) -> bool:
        return bool(self.rooms)

    def poll(self) -> None:
        """Reserves rooms the engine admitted (engine.step admits), finishes delivered ones, fails
        late or broken ones."""
        self._housekeeping()
        for room, r in list(self.rooms.items()):
            try:
                if r.reservation is None:
                    self._reserve(room, r)
                else:
                    self._progress(room, r)
            except HandoffFailure as e:  # quiesced: the prefill answered, so it sent all it will
                self._fail(room, r, e.reason, quiesced=self._client(r.bootstrap).outcome(room) is not None)
            except Exception as e:  # a rank call failed: only a broken group (RankError) stops the loop
                self._fail(room, r, f"{type(e).__name__}: {e}", quiesced=False)
                if isinstance(e, RankError):
                    raise

    def _client(self, endpoint: str) -> DecodeClient:
        client = self.clients.get(endpoint)
        if client is None:
            self._close_idle(self.max_clients - 1)
            client = self.clients[endpoint] = DecodeClient(endpoint, self.frame_key, self.ctx)
        self.clients.move_to_end(endpoint)
        return client

    def _close_idle(self, keep: int, idle_s: float = 0.0) -> None:
        """Closes clients with no open room, least recently used first, idle for idle_s at least,
        until at most `keep` are left (a client with an open room is never closed)."""
        busy = {r.bootstrap for r in self.rooms.values()}
        now = time.monotonic()
        for endpoint, client in list(self.clients.items()):
            if len(self.clients) <= keep:
                return
            if endpoint not in busy and now - client.used >= idle_s:
                del self.clients[endpoint]
                client.close()
                self.clients_closed += 1

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + LISTENER_CHECK_S
        self._close_idle(0, self.client_idle_s)
        self.listener_error = self.engine.instance.listener_problem()

    def unhealthy(self) -> str | None:
        """Why hand-offs cannot be received (a rank's receiver thread died or is wedged), or None: for
        /health. Thread-safe: the last answer of the engine thread's check."""
        return self.listener_error

    def _reserve(self, room: str, r: _Room) -> None:
        req = self.engine.scheduler.waiting_for_kv.get(room)
        if req is None:
            return  # still queued for pages
        inst = self.engine.instance
        try:
            r.reservation = inst.reservation(room, req.pages, prompt_len=r.prompt_len)
        except RuntimeError as e:  # a rank could not stage the room
            raise HandoffFailure(str(e)) from None
        inst.expect_totals(room, r.reservation.ticket, req.pages, r.prompt_len)  # before anything is sent
        r.nbytes = inst.handoff_bytes(req.pages, r.prompt_len)  # now, while the plan is at hand
        self._client(r.bootstrap).send(r.reservation)
        r.sent = time.monotonic()
        r.deadline = r.sent + r.timeout_s

    def _progress(self, room: str, r: _Room) -> None:
        client = self._client(r.bootstrap)
        done = poll_room(self.engine, client, room, r.deadline, r.timeout_s)
        if done is not None:
            self._complete(room, r, done)
        elif (
            room not in client.outcomes
            and (silent := client.silent_for(r.bootstrap, r.sent)) > self.heartbeat_timeout_s
        ):
            raise HandoffFailure(
                f"the prefill instance at {r.bootstrap} stopped answering (no heartbeat for {silent:.1f} s)"
            )

    def _complete(self, room: str, r: _Room, done: TransferDone) -> None:
        verify_done(self.engine, r.reservation, done)
        self.bytes_received += r.nbytes
        self.transfer_seconds += time.monotonic() - r.sent
        self._forget(room, quiesced=True)
        req = self.engine.kv_ready(room, done.first_token)
        self.completed += 1
        self.emit(room, ("token", done.first_token))
        if req.state == "finished":
            self.emit(room, ("finish", req.finish_reason))

    def _fail(self, room: str, r: _Room, reason: str, quiesced: bool) -> None:
        self.failed += 1
        if r.reservation is not None:
            self._client(r.bootstrap).send(TransferFailed(room, reason))  # a prefill still working stops
        self._release(room, r, quiesced)
        self.emit(room, ("error", f"KV transfer failed: {reason}"))

    def abort(self, room: str) -> bool:
        """The client went away: releases the room (True when it was pending here)."""
        r = self.rooms.get(room)
        if r is None:
            return False
        if r.reservation is not None:
            self._client(r.bootstrap).send(TransferFailed(room, "aborted by the decode instance"))
        self._release(room, r, quiesced=False)
        return True

    def _release(self, room: str, r: _Room, quiesced: bool) -> None:
        hold_s = 0.0
        if r.reservation is not None:
            hold_s = self._forget(room, quiesced)
        else:
            self.rooms.pop(room, None)
        self.engine.abort(room, hold_s)  # hold_s > 0: senders may still WRITE into its pages

    def _forget(self, room: str, quiesced: bool) -> float:
        r = self.rooms.pop(room)
        self._client(r.bootstrap).forget(room)
        self._close_idle(self.max_clients)  # a burst of rooms may have opened more clients than the bound
        return self.engine.instance.forget(room, quiesced)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()
        self.ctx.term()
