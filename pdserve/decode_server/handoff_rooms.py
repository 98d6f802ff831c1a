"""The decode instance's hand-off rooms: a table of `DecodeRoom` machines (transfer/decode_room.py)
and the side-channel clients they talk through, polled by the thread that owns the decode engine.
Server orchestration, so it lives here and not in transfer/ (the leaf): it speaks the server's event
vocabulary (serving/instance_loop.py) and asks the ranks.

A request submitted with a `bootstrap` endpoint (a prefill instance's side channel) gets its cache
by hand-off instead of a local prefill. `poll()` advances every room once; `reserve_admitted()`
reserves only rooms the engine has just admitted (called right after the engine's step, so a room
admitted by that step is reserved in the same loop iteration). Success emits the first token (the
prefill's) and, when that ends the request, its finish; a failure emits one error event. An abort
(client gone) releases the room the same way, without an event.

The owning thread owns every DecodeClient (ZMQ sockets are single-threaded). Clients are cached per
prefill bootstrap endpoint, share one ZMQ context (a client costs a socket, not I/O threads), and are
bounded: one with no open room is closed after `client_idle_s`, and beyond `max_clients` the least
recently used idle one goes first (so a stream of distinct -- even bogus -- endpoints cannot exhaust
threads or file descriptors).

Health (docs/design.md invariant 11): every LISTENER_CHECK_S the owning thread asks the ranks whether
their data-path receiver threads live; `unhealthy()` returns the last answer for /health without
touching the ranks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

import zmq

from ..request import SamplingParams
from ..runtime.launcher import RankError
from ..serving.instance_loop import Event, Failed, Finished, Token
from ..transfer.base import KVPoll
from ..transfer.decode_client import DecodeClient
from ..transfer.decode_room import DecodeRoom
from ..transfer.frames import DEV_FRAME_KEY
from ..transfer.interfaces import KVDestination

Emit = Callable[[str, Event], None]  # (request_id, event) -> delivered to its listener
MAX_CLIENTS = 64
CLIENT_IDLE_S = 60.0
LISTENER_CHECK_S = 2.0


class DecodeRooms:
    def __init__(
        self,
        dest: KVDestination,
        emit: Emit,
        transfer_timeout_s: float = 30.0,
        heartbeat_timeout_s: float = 5.0,
        frame_key: bytes = DEV_FRAME_KEY,
        max_clients: int = MAX_CLIENTS,
        client_idle_s: float = CLIENT_IDLE_S,
    ):
        self.dest, self.emit, self.transfer_timeout_s = dest, emit, transfer_timeout_s
        self.heartbeat_timeout_s, self.frame_key = heartbeat_timeout_s, frame_key
        self.max_clients, self.client_idle_s = max_clients, client_idle_s
        self.rooms: dict[str, DecodeRoom] = {}
        self.ctx = zmq.Context()  # shared by every client
        self.clients: OrderedDict[str, DecodeClient] = OrderedDict()  # least recently used first
        self.clients_closed = 0
        self.clients_replaced = 0  # clients whose connection closed (transfer/decode_client.py)
        self.listener_error: str | None = None  # a rank's receiver thread is dead or wedged (for /health)
        self._next_check = 0.0
        self.completed = self.failed = 0
        self.bytes_received, self.transfer_seconds = 0, 0.0  # over completed hand-offs

    def submit(
        self,
        room: str,
        prompt_len: int,
        params: SamplingParams,
        bootstrap: str,
        timeout_s: float | None = None,
        prompt_ids: list[int] | None = None,
    ) -> DecodeRoom:
        """Queues the request; ValueError when it can never fit (nothing is kept then). prompt_ids:
        for the destination's prefix cache."""
        if room in self.rooms:
            raise ValueError(f"room {room!r} is already in use")
        self.dest.submit(room, prompt_len, params, prompt_ids)
        r = self.rooms[room] = DecodeRoom(
            self.dest, room, prompt_len, bootstrap, timeout_s or self.transfer_timeout_s
        )
        return r

    @property
    def pending(self) -> bool:
        return bool(self.rooms)

    def poll(self) -> None:
        """Advances every room once: reserves admitted ones, finishes delivered ones, fails late or
        broken ones. Only a broken rank group (RankError) propagates."""
        self._housekeeping()
        for r in list(self.rooms.values()):
            self._poll(r)

    def reserve_admitted(self) -> None:
        """Advances only the rooms still waiting for their pages (no rank call unless one was admitted)."""
        for r in list(self.rooms.values()):
            if r.state is KVPoll.Bootstrapping:
                self._poll(r)

    def _poll(self, r: DecodeRoom) -> None:
        try:
            r.poll(self._client(r.bootstrap), self.heartbeat_timeout_s)
        except RankError:
            self._ended(r)
            raise
        except Exception:  # the room failed (a rank command raised): the instance goes on
            pass
        self._ended(r)

    def _ended(self, r: DecodeRoom) -> None:
        if not r.s.done:
            return
        del self.rooms[r.room]
        self._close_idle(self.max_clients)  # a burst of rooms may have opened more clients than the bound
        if r.state is KVPoll.Success:
            self.completed += 1
            self.bytes_received += r.nbytes
            self.transfer_seconds += time.monotonic() - r.sent
            self.emit(r.room, Token(r.done.first_token, r.done.first_logprob))
            if r.request.state == "finished":
                self.emit(r.room, Finished(r.request.finish_reason))
        else:
            self.failed += 1
            self.emit(r.room, Failed(f"KV transfer failed: {r.s.reason}"))

    def abort(self, room: str) -> bool:
        """The client went away: releases the room (True when it was pending here)."""
        r = self.rooms.pop(room, None)
        if r is None:
            return False
        r.abort(self._client(r.bootstrap))
        return True

    def _client(self, endpoint: str) -> DecodeClient:
        client = self.clients.get(endpoint)
        if (
            client is not None and client.replaceable()
        ):  # its connection closed: a new one proves its peer anew
            del self.clients[endpoint]
            client.close()
            self.clients_replaced += 1
            client = None
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
        self.listener_error = self.dest.listener_problem()

    def unhealthy(self) -> str | None:
        """Why hand-offs cannot be received (a rank's receiver thread died or is wedged), or None: for
        /health. Thread-safe: the last answer of the owning thread's check."""
        return self.listener_error

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()
        self.ctx.term()
