"""The side channel between the two main processes of a hand-off: ZMQ ROUTER (prefill) <- DEALER (decode).

    decode  --DecodeReservation-->  prefill     (where each decode rank wants its rows; fingerprint)
    decode  <--TransferDone-------  prefill     (sent after every data frame: first token, checksums, layout echo)
    decode  <--TransferFailed-----  prefill     (refused fingerprint, prefill error)
    decode  --TransferFailed-->     prefill     (decode aborted the room: the prefill stops and releases)
    either  --Heartbeat-->                      (liveness; the last one seen per peer is kept)

The prefill's `BootstrapServer` binds one ROUTER socket (ephemeral port, `endpoint`); every decode
instance connects one DEALER (`DecodeClient`). The server answers a room on the DEALER that
reserved it. Both sides are polled from one thread each (ZMQ sockets are not thread-safe).
Frames that do not decode are counted and dropped: a bad peer can fail its rooms, not the server.

Heartbeats: a prefill server runs `BootstrapService`, whose own thread owns the socket, so it keeps
answering while the scheduler's thread is deep in a long prefill. Every HEARTBEAT_S it sends a
Heartbeat (sender = its endpoint) to each decode instance with an open room; a decode instance
that hears nothing from a prefill for its heartbeat timeout while it waits on one of its rooms
fails those rooms at once instead of waiting out the whole transfer timeout (a dead prefill).
"""

from __future__ import annotations

import queue
import threading
import time

import zmq

from .messages import DecodeReservation, Heartbeat, ProtocolError, TransferDone, TransferFailed, decode, encode


class BootstrapTimeout(TimeoutError):
    pass


class _Endpoint:
    def __init__(self, kind: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)  # a dead peer must not block close()
        self.bad_frames = 0
        self.heartbeats: dict[str, float] = {}  # peer -> when (time.monotonic) its last heartbeat came

    def _recv(self, timeout_ms: int) -> list[bytes] | None:
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def _decode(self, frame: bytes):
        try:
            msg = decode(frame)
        except ProtocolError:
            self.bad_frames += 1
            return None
        if isinstance(msg, Heartbeat):
            self.heartbeats[msg.sender] = time.monotonic()
            return None
        return msg

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class BootstrapServer(_Endpoint):
    """Prefill side: collects reservations (they may come before the prompt), answers per room."""

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(zmq.ROUTER)
        self.endpoint = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.reservations: dict[str, DecodeReservation] = {}
        self.peers: dict[str, bytes] = {}  # room -> DEALER identity that reserved it
        self.aborted: dict[str, str] = {}  # room -> decode's reason

    def drain(self, timeout_ms: int = 0) -> None:
        while (parts := self._recv(timeout_ms)) is not None:
            timeout_ms = 0
            if len(parts) != 2:
                self.bad_frames += 1
                continue
            identity, msg = parts[0], self._decode(parts[1])
            if isinstance(msg, DecodeReservation):
                self.reservations[msg.room], self.peers[msg.room] = msg, identity
                self.aborted.pop(msg.room, None)
            elif isinstance(msg, TransferFailed):
                if msg.room in self.reservations:  # else already answered: keeping it would leak
                    self.aborted[msg.room] = msg.reason
            elif msg is not None:
                self.bad_frames += 1

    def wait_reservation(self, room: str, timeout_s: float) -> DecodeReservation:
        """The decode reservation of `room`; BootstrapTimeout when none came within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while room not in self.reservations:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BootstrapTimeout(f"bootstrap timeout: no decode reservation for room {room} within {timeout_s} s")
            self.drain(int(min(left, 0.05) * 1000) + 1)
        return self.reservations[room]

    def reply(self, msg: TransferDone | TransferFailed) -> None:
        """Answers the decode instance that reserved msg.room, then forgets the room."""
        identity = self.peers.get(msg.room)
        if identity is None:
            raise KeyError(f"no decode instance reserved room {msg.room}")
        self._send([identity, encode(msg)])
        self.forget(msg.room)

    def _send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def forget(self, room: str) -> None:
        self.reservations.pop(room, None)
        self.peers.pop(room, None)
        self.aborted.pop(room, None)


HEARTBEAT_S = 0.5  # how often a BootstrapService tells each decode peer with an open room it lives


class BootstrapService(BootstrapServer):
    """A BootstrapServer whose socket belongs to its own thread (started here): `drain`, `reply` and
    `forget` may be called from the scheduler's thread at any time, and heartbeats go out even while
    that thread is busy. The room tables are plain dicts read without the lock (single operations
    on them are atomic in CPython); the thread changes them under `lock`."""

    def __init__(self, host: str = "127.0.0.1"):
        super().__init__(host)
        self.lock = threading.Lock()
        self.generation = time.time_ns()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (identity, frame) to send
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bootstrap", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if self.sock.poll(5):
                with self.lock:
                    super().drain()
                self._arrived.set()
            while not self._outbox.empty():
                self.sock.send_multipart(self._outbox.get_nowait())
            if time.monotonic() >= next_beat:
                beat = encode(Heartbeat(self.endpoint, self.generation, time.time()))
                for identity in set(self.peers.values()):
                    self.sock.send_multipart([identity, beat])
                next_beat = time.monotonic() + HEARTBEAT_S

    def drain(self, timeout_ms: int = 0) -> None:
        """Waits up to timeout_ms for a new message (the thread takes them in as they come)."""
        if timeout_ms > 0 and self._arrived.wait(timeout_ms / 1000):
            self._arrived.clear()

    def _send(self, frames: list[bytes]) -> None:
        self._outbox.put(frames)  # the thread sends it: the socket is its alone

    def forget(self, room: str) -> None:
        with self.lock:
            super().forget(room)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        super().close()


class DecodeClient(_Endpoint):
    """Decode side: reserves rooms, receives their outcome."""

    def __init__(self, bootstrap_endpoint: str):
        super().__init__(zmq.DEALER)
        self.sock.connect(bootstrap_endpoint)
        self.outcomes: dict[str, TransferDone | TransferFailed] = {}

    def send(self, msg: DecodeReservation | TransferFailed | Heartbeat) -> None:
        self.sock.send(encode(msg))

    def drain(self, timeout_ms: int = 0) -> None:
        while (parts := self._recv(timeout_ms)) is not None:
            timeout_ms = 0
            msg = self._decode(parts[-1])
            if isinstance(msg, (TransferDone, TransferFailed)):
                self.outcomes[msg.room] = msg
            elif msg is not None:
                self.bad_frames += 1

    def outcome(self, room: str) -> TransferDone | TransferFailed | None:
        self.drain()
        return self.outcomes.get(room)

    def silent_for(self, peer: str, since: float) -> float:
        """Seconds since `peer` was last heard from (a heartbeat), counting from `since` at the latest."""
        return time.monotonic() - max(self.heartbeats.get(peer, since), since)

    def forget(self, room: str) -> None:
        self.outcomes.pop(room, None)
