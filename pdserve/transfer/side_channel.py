"""The side channel between the two main processes of a hand-off: ZMQ ROUTER (prefill) <- DEALER (decode).

    decode  --DecodeReservation-->  prefill     (where each decode rank wants its rows; fingerprint)
    decode  <--TransferDone-------  prefill     (sent after every data frame: first token, checksums, layout echo)
    decode  <--TransferFailed-----  prefill     (refused fingerprint, prefill error)
    decode  --TransferFailed-->     prefill     (decode aborted the room: the prefill stops and releases)
    either  --Heartbeat-->                      (liveness; the last one seen per peer is kept)

The prefill's `BootstrapServer` binds one ROUTER socket (ephemeral port, `endpoint`); every decode
instance connects one DEALER (`DecodeClient`, transfer/decode_client.py; both sides' sockets are
transfer/side_endpoint.py `Endpoint`s). The server answers a room on the DEALER that
reserved it. Both sides are polled from one thread each (ZMQ sockets are not thread-safe).
Frames that do not decode are counted and dropped: a bad peer can fail its rooms, not the server.

Heartbeats: a prefill server runs `BootstrapService`, whose own thread owns the socket, so it keeps
answering while the scheduler's thread is deep in a long prefill. Every HEARTBEAT_S it sends a
Heartbeat (sender = its endpoint) to each decode instance with an open room; a decode instance
that hears nothing from a prefill for its heartbeat timeout while it waits on one of its rooms
fails those rooms at once instead of waiting out the whole transfer timeout (a dead prefill).

Authentication (docs/design.md invariant 11, transfer/frames.py): every frame is [message, HMAC tag]
under the cluster frame key, signed with its direction's label; a frame whose tag does not verify
is dropped and counted (`unauthenticated`) before anything of it is decoded, and one that verifies
but does not decode is counted in `bad_frames`. A client sends `Hello(nonce)` first and holds every
other message -- reservations carry its ranks' endpoints and NIXL agent metadata -- until the peer
answered `Welcome(nonce)` under the prefill->decode label, i.e. proved it holds the key.

Rooms: the first reservation of a room wins (a later one, from any peer, is refused and counted);
only the peer that reserved a room can abort it. A reservation that no request claimed within
`reservation_ttl_s` expires; at most MAX_RESERVATIONS are kept. Heartbeat senders kept: MAX_PEERS.
Every receive path is guarded: no frame, however malformed, stops BootstrapService's thread, and
`unhealthy()` names a dead or wedged one (for /health).

Floods (issue 40 item 2). The server's socket is open to anyone who can reach its port, so the
receive loop is bounded: one `drain()` takes at most TURN_FRAMES frames or TURN_S seconds, then
BootstrapService's thread sends its outbox (Welcomes, outcomes) and its heartbeats -- every turn,
whatever comes in. Before a frame's HMAC is computed, cheap screens drop it: its ZMQ identity is
muted, it has not [message, 32-byte tag] parts, or it does not begin as a registered message
(`looks_like_message`). An identity (one connection) that never sent an authentic frame and sends
STRIKES frames that fail a screen or their tag within STRIKE_WINDOW_S is muted for MUTE_S: its frames are read and dropped
without an HMAC (`muted_frames`). The lock that guards the room tables is taken per authenticated message, never
while junk is read. ROUTER fair-queues its peers, so a keyed client's Hello is read within a few
turns of a flood, and answered in the same turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from typing import Callable

import zmq

from ..serving.auth import MAC_BYTES
from .frames import D2P, DEV_FRAME_KEY, P2D, Liveness
from .messages import (
    DecodeReservation,
    Heartbeat,
    Hello,
    TransferDone,
    TransferFailed,
    Welcome,
    looks_like_message,
)
from .side_endpoint import MAX_PEERS, Endpoint

MAX_RESERVATIONS = 4096
RESERVATION_TTL_S = 120.0
EXPIRE_EVERY_S = 1.0
TURN_FRAMES, TURN_S = 256, 0.01  # at most this many frames, or this long, per drain() turn
STRIKES, STRIKE_WINDOW_S, MUTE_S = 64, 1.0, 5.0  # unauthenticated frames per identity before it is muted


class BootstrapTimeout(TimeoutError):
    pass


class BootstrapServer(Endpoint):
    """Prefill side: collects reservations (they may come before the prompt), answers per room."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        key: bytes = DEV_FRAME_KEY,
        reservation_ttl_s: float = RESERVATION_TTL_S,
        clock: Callable[[], float] = time.monotonic,  # how old a reservation is (expire)
    ):
        super().__init__(zmq.ROUTER, key, P2D, D2P)
        self.clock = clock
        self.endpoint = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.reservation_ttl_s = reservation_ttl_s
        self.reservations: dict[str, DecodeReservation] = {}
        self.peers: dict[str, bytes] = {}  # room -> DEALER identity that reserved it
        self.aborted: dict[str, str] = {}  # room -> decode's reason
        self.reserved_at: dict[str, float] = {}
        self.claimed: set[str] = set()  # rooms a request is being served for: never expired
        self.refused = (
            0  # a second reservation of a room, an abort from a peer that did not reserve it, overflow
        )
        self.expired = 0
        self._next_expiry = 0.0
        self.strikes: dict[bytes, tuple[float, int]] = {}  # identity -> (window start, bad frames in it)
        self.muted: dict[bytes, float] = {}  # identity -> until when (time.monotonic) its frames are dropped
        self.keyed: dict[bytes, None] = {}  # identities that sent an authentic frame (oldest first)
        self.mutes = 0  # identities muted so far
        self.muted_frames = 0  # frames of muted identities, dropped before any check

    def drain(self, timeout_ms: int = 0) -> None:
        """Takes in what came, within one turn's budget (TURN_FRAMES frames, TURN_S seconds)."""
        self._turn_in(timeout_ms)
        if time.monotonic() >= self._next_expiry:
            self.expire()

    def _turn_in(self, timeout_ms: int) -> None:
        deadline = time.monotonic() + TURN_S
        for _ in range(TURN_FRAMES):
            if (parts := self._recv(timeout_ms)) is None:
                return
            timeout_ms = 0
            try:
                msg = self._screen(parts)
                if msg is not None:
                    with self._guard():
                        self._take(parts[0], msg)
            except Exception:  # never expected: the frame is dropped, the server goes on
                self.bad_frames += 1
            if time.monotonic() >= deadline:
                return

    def _guard(self):
        return contextlib.nullcontext()  # polled by its owner: nobody else touches the tables

    def _screen(self, parts: list[bytes]):
        """The message of [identity, frame, tag], or None: cheap screens first, then the HMAC."""
        identity, now = parts[0], time.monotonic()
        if self.muted.get(identity, 0.0) > now:
            self.muted_frames += 1
            return None
        if len(parts) != 3 or len(parts[2]) != MAC_BYTES or not looks_like_message(parts[1]):
            self.unauthenticated += 1
            self._strike(identity, now)
            return None
        before = self.unauthenticated
        msg = self._open(parts[1:])
        if self.unauthenticated != before:
            self._strike(identity, now)
        else:  # it holds the key: never muted
            self.keyed.pop(identity, None)
            if len(self.keyed) >= MAX_PEERS:
                del self.keyed[next(iter(self.keyed))]
            self.keyed[identity] = None
            self.strikes.pop(identity, None)
        return msg

    def _strike(self, identity: bytes, now: float) -> None:
        """Counts one bad frame against an identity that never sent an authentic one; STRIKES within
        STRIKE_WINDOW_S mute it for MUTE_S."""
        if identity in self.keyed:
            return
        since, n = self.strikes.pop(identity, (now, 0))
        if now - since > STRIKE_WINDOW_S:
            since, n = now, 0
        if n + 1 >= STRIKES:
            self.muted.pop(identity, None)
            if len(self.muted) >= MAX_PEERS:
                del self.muted[next(iter(self.muted))]
            self.muted[identity] = now + MUTE_S
            self.mutes += 1
            return
        if len(self.strikes) >= MAX_PEERS:
            del self.strikes[next(iter(self.strikes))]
        self.strikes[identity] = (since, n + 1)

    def _take(self, identity: bytes, msg) -> None:
        room = getattr(msg, "room", None)
        if isinstance(msg, Hello):
            self._send([identity, *self._seal(Welcome(msg.nonce))])
        elif isinstance(msg, DecodeReservation):
            if room in self.reservations or len(self.reservations) >= MAX_RESERVATIONS:
                if self.reservations.get(room) != msg:  # the same reservation again is no refusal
                    self.refused += 1
                return
            self.reservations[room], self.peers[room] = msg, identity
            self.reserved_at[room] = self.clock()
            self.aborted.pop(room, None)
        elif isinstance(msg, TransferFailed):
            reservation = self.reservations.get(room)
            if reservation is not None and msg.ticket and msg.ticket != reservation.ticket:
                self.refused += 1  # an abort of an earlier use of the room id
            elif self.peers.get(room) == identity:
                self.aborted[room] = msg.reason
            elif room in self.reservations:
                self.refused += 1  # another peer's room
        else:
            self.bad_frames += 1

    def expire(self) -> None:
        """Forgets reservations nobody claimed within reservation_ttl_s (their request never came)."""
        self._next_expiry = time.monotonic() + EXPIRE_EVERY_S
        now = self.clock()
        for room, since in list(self.reserved_at.items()):
            if now - since > self.reservation_ttl_s and room not in self.claimed:
                self.expired += 1
                self.forget(room)

    def claim(self, room: str) -> DecodeReservation | None:
        """The room's reservation, now kept until forget() (None when there is none, e.g. it expired)."""
        r = self.reservations.get(room)
        if r is not None:
            self.claimed.add(room)
        return r

    def wait_reservation(self, room: str, timeout_s: float) -> DecodeReservation:
        """The decode reservation of `room`; BootstrapTimeout when none came within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while room not in self.reservations:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BootstrapTimeout(
                    f"bootstrap timeout: no decode reservation for room {room} within {timeout_s} s"
                )
            self.drain(int(min(left, 0.05) * 1000) + 1)
        return self.reservations[room]

    def reply(self, msg: TransferDone | TransferFailed) -> None:
        """Answers the decode instance that reserved msg.room, then forgets the room."""
        identity = self.peers.get(msg.room)
        if identity is None:
            raise KeyError(f"no decode instance reserved room {msg.room}")
        msg = dataclasses.replace(msg, ticket=self.reservations[msg.room].ticket)
        self._send([identity, *self._seal(msg)])
        self.forget(msg.room)

    def _send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def forget(self, room: str) -> None:
        for table in (self.reservations, self.peers, self.aborted, self.reserved_at):
            table.pop(room, None)
        self.claimed.discard(room)

    def unhealthy(self) -> str | None:
        return None  # polled by its owner: no thread of its own


HEARTBEAT_S = 0.5  # how often a BootstrapService tells each decode peer with an open room it lives


class BootstrapService(BootstrapServer):
    """A BootstrapServer whose socket belongs to its own thread (started here): `drain`, `reply` and
    `forget` may be called from the scheduler's thread at any time, and heartbeats go out even while
    that thread is busy. The room tables are plain dicts read without the lock (single operations
    on them are atomic in CPython); the thread changes them under `lock`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        key: bytes = DEV_FRAME_KEY,
        reservation_ttl_s: float = RESERVATION_TTL_S,
    ):
        super().__init__(host, key, reservation_ttl_s)
        self.lock = threading.Lock()
        self.generation = time.time_ns()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (identity, frame) to send
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self.live = Liveness("bootstrap side-channel")
        self._thread = self.live.thread = threading.Thread(target=self._loop, name="bootstrap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self.live.beat()
            try:
                next_beat = self._turn(next_beat)
            except Exception:  # never expected (frames are guarded in drain): the thread must go on
                self.live.crashes += 1
                time.sleep(0.01)

    def _turn(self, next_beat: float) -> float:
        if self.sock.poll(5):
            self._turn_in(0)  # bounded; the lock is taken per authenticated message
            self._arrived.set()
        if time.monotonic() >= self._next_expiry:
            with self.lock:
                self.expire()
        while not self._outbox.empty():
            self.sock.send_multipart(self._outbox.get_nowait())
        if time.monotonic() >= next_beat:
            beat = self._seal(Heartbeat(self.endpoint, self.generation, time.time()))
            for identity in set(self.peers.values()):
                self.sock.send_multipart([identity, *beat])
            next_beat = time.monotonic() + HEARTBEAT_S
        return next_beat

    def drain(self, timeout_ms: int = 0) -> None:
        """Waits up to timeout_ms for a new message (the thread takes them in as they come)."""
        if timeout_ms > 0 and self._arrived.wait(timeout_ms / 1000):
            self._arrived.clear()

    def _send(self, frames: list[bytes]) -> None:
        self._outbox.put(frames)  # the thread sends it: the socket is its alone

    def _guard(self):
        return self.lock

    def forget(self, room: str) -> None:
        with self.lock:
            super().forget(room)

    def claim(self, room: str) -> DecodeReservation | None:
        with self.lock:
            return super().claim(room)

    def unhealthy(self) -> str | None:
        """Why the side channel cannot serve (its thread died or is wedged), or None: for /health."""
        return self.live.problem()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        super().close()
