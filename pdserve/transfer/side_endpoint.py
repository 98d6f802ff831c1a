"""One socket of the hand-off's side channel (transfer/side_channel.py has the protocol): frames
out are [message, HMAC tag] sealed under its direction's label, frames in are opened only when their
tag verifies under the other label; heartbeats are kept per peer (at most MAX_PEERS)."""

from __future__ import annotations

import time

import zmq

from ..serving.auth import sign, verify
from .frames import SIDE_MAX_BYTES
from .messages import Heartbeat, ProtocolError, decode, encode

MAX_PEERS = 1024


class Endpoint:
    """One side-channel socket: frames out are sealed under `send_label`, frames in must verify under `recv_label`."""

    def __init__(
        self, kind: int, key: bytes, send_label: bytes, recv_label: bytes, ctx: zmq.Context | None = None
    ):
        self.own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)  # a dead peer must not block close()
        self.sock.setsockopt(zmq.MAXMSGSIZE, SIDE_MAX_BYTES + 4096)  # a larger frame disconnects its sender
        self.key, self.send_label, self.recv_label = key, send_label, recv_label
        self.bad_frames = 0  # authenticated, but not a message this side takes
        self.unauthenticated = 0  # no valid tag: dropped undecoded
        self.heartbeats: dict[str, float] = {}  # peer -> when (time.monotonic) its last heartbeat came

    def _recv(self, timeout_ms: int) -> list[bytes] | None:
        if not self.sock.poll(timeout_ms):
            return None
        return self.sock.recv_multipart()

    def _seal(self, msg) -> list[bytes]:
        frame = encode(msg)
        return [frame, sign(self.key, self.send_label, frame)]

    def _open(self, parts: list[bytes]):
        """The message of [frame, tag], or None (counted) when it is not authentic or not a message."""
        if len(parts) != 2 or not verify(self.key, parts[1], self.recv_label, parts[0]):
            self.unauthenticated += 1
            return None
        try:
            msg = decode(parts[0])
        except ProtocolError:
            self.bad_frames += 1
            return None
        if isinstance(msg, Heartbeat):
            self._heard(msg.sender)
            return None
        return msg

    def _heard(self, sender: str) -> None:
        self.heartbeats.pop(sender, None)  # re-inserted last: the dict is oldest-first
        if len(self.heartbeats) >= MAX_PEERS:
            del self.heartbeats[next(iter(self.heartbeats))]
        self.heartbeats[sender] = time.monotonic()

    def close(self) -> None:
        self.sock.close()
        if self.own_ctx:
            self.ctx.term()
