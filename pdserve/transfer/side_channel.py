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
"""

from __future__ import annotations

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
        self.heartbeats: dict[str, Heartbeat] = {}

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
            self.heartbeats[msg.sender] = msg
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
        self.sock.send_multipart([identity, encode(msg)])
        self.forget(msg.room)

    def forget(self, room: str) -> None:
        self.reservations.pop(room, None)
        self.peers.pop(room, None)
        self.aborted.pop(room, None)


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

    def forget(self, room: str) -> None:
        self.outcomes.pop(room, None)
