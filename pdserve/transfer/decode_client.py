"""The decode side of the hand-off's side channel (transfer/side_channel.py has the protocol): one
DEALER per prefill instance, which says Hello first and holds every other message until the peer's
Welcome proved it holds the frame key, reserves rooms and keeps their outcomes.

The proof holds for one connection, not for the socket (issue 40 item 7): a DEALER reconnects by
itself, and whatever listens at the address next -- a restarted prefill, or anyone who took the
port -- would get the reservations (NIXL agent metadata) without having proven anything. So a
client never reconnects (ZMQ_RECONNECT_IVL -1): when its connection closes (a socket monitor says
so) it is `dead`, sends nothing more, and DecodeRooms replaces it with a new client, whose new
connection says a new Hello. Rooms open on the dead one fail by heartbeat timeout, as they did when a
reconnected DEALER (a new identity to the ROUTER) never got their outcomes."""

from __future__ import annotations

import secrets
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from .frames import D2P, DEV_FRAME_KEY, P2D
from .messages import DecodeReservation, Heartbeat, Hello, TransferDone, TransferFailed, Welcome
from .side_endpoint import Endpoint

MAX_HELD = 4096  # messages a client holds until its peer proved it has the key
REPLACE_AFTER_S = 0.1  # ZMQ's own reconnect interval


class DecodeClient(Endpoint):
    """Decode side: reserves rooms, receives their outcome. `ctx`: a shared ZMQ context (DecodeRooms
    keeps one for all its clients, so a client costs a socket, not two I/O threads)."""

    def __init__(self, bootstrap_endpoint: str, key: bytes = DEV_FRAME_KEY, ctx: zmq.Context | None = None):
        super().__init__(zmq.DEALER, key, D2P, P2D, ctx)
        self.endpoint = bootstrap_endpoint
        self.sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one connection per client: see the module doc
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        self.dead = False  # its connection closed (or never opened): DecodeRooms makes a new client
        self.dead_since = 0.0  # time.monotonic() when it was found dead
        self.sock.connect(bootstrap_endpoint)
        self.nonce, self.ready = secrets.token_bytes(16), False
        self.held: list = []  # messages waiting for the peer's Welcome
        self.open: dict[str, bytes] = {}  # room -> ticket, reserved through this client: only their
        # outcomes are kept, and only with that ticket (or none)
        self.outcomes: dict[str, TransferDone | TransferFailed] = {}
        self.stale = 0
        self.used = time.monotonic()
        self._post(Hello(self.nonce))

    def replaceable(self) -> bool:
        """Dead for REPLACE_AFTER_S: a new client may try the address again (as often as a DEALER
        would reconnect by itself, so an unreachable peer costs a socket per interval, not per poll)."""
        self._watch()
        return self.dead and time.monotonic() - self.dead_since >= REPLACE_AFTER_S

    def _watch(self) -> bool:
        """Whether the connection still lives (takes the monitor's news first)."""
        while not self.dead and self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                self.dead, self.dead_since = True, time.monotonic()
        return not self.dead

    def _post(self, msg) -> None:
        if not self._watch():
            return  # nothing goes out after the proven connection closed: its rooms fail by timeout
        try:
            self.sock.send_multipart(self._seal(msg), zmq.NOBLOCK)
        except zmq.Again:  # the peer takes nothing: its rooms fail by heartbeat timeout
            pass

    def send(self, msg: DecodeReservation | TransferFailed | Heartbeat) -> None:
        self.used = time.monotonic()
        if isinstance(msg, DecodeReservation):
            self.outcomes.pop(msg.room, None)
            self.open[msg.room] = msg.ticket
        if self.ready:
            return self._post(msg)
        if isinstance(msg, TransferFailed) and any(getattr(m, "room", None) == msg.room for m in self.held):
            self.held = [
                m for m in self.held if getattr(m, "room", None) != msg.room
            ]  # never sent: nothing to abort
            return
        if len(self.held) < MAX_HELD:
            self.held.append(msg)

    def drain(self, timeout_ms: int = 0) -> None:
        self._watch()
        while (parts := self._recv(timeout_ms)) is not None:
            timeout_ms = 0
            try:
                msg = self._open(parts)
                if msg is not None:
                    self._take(msg)
            except Exception:  # never expected: the frame is dropped, the loop thread goes on
                self.bad_frames += 1

    def _take(self, msg) -> None:
        if isinstance(msg, Welcome) and msg.nonce == self.nonce and not self.ready:
            self.ready = True
            held, self.held = self.held, []
            for m in held:
                self._post(m)
        elif isinstance(msg, (TransferDone, TransferFailed)) and msg.room in self.open:
            if msg.ticket in (b"", self.open[msg.room]):
                self.outcomes[msg.room] = msg
            else:
                self.stale += 1  # the outcome of an earlier use of the room id
        else:
            self.bad_frames += 1

    def wait_ready(self, timeout_s: float, pump=None) -> bool:
        """Drains until the peer's Welcome came (True) or timeout_s passed; pump(), if given, runs
        between tries (a polled BootstrapServer in the same thread: its drain answers the Hello)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready and time.monotonic() < deadline:
            if pump is not None:
                pump()
            self.drain(5)
        return self.ready

    def outcome(self, room: str) -> TransferDone | TransferFailed | None:
        self.drain()
        return self.outcomes.get(room)

    def silent_for(self, peer: str, since: float) -> float:
        """Seconds since `peer` was last heard from (a heartbeat), counting from `since` at the latest."""
        return time.monotonic() - max(self.heartbeats.get(peer, since), since)

    def forget(self, room: str) -> None:
        self.outcomes.pop(room, None)
        self.open.pop(room, None)
        self.used = time.monotonic()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        super().close()
