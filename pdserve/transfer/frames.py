"""Authenticated frames of the transfer layer (docs/design.md invariant 11), shared by the side channel,
the TCP data path and NIXL notifications.

Every frame carries an HMAC-SHA256 tag under the cluster's frame key (serving/auth.frame_key of the
internal token), checked BEFORE anything of the frame is decoded; a frame whose tag does not verify
is dropped and counted. Why HMAC and not ZMQ CURVE: the one cluster secret keys everything (no
per-instance key pairs to make, distribute and rotate), it works the same for ZMQ side-channel
frames, TCP data frames and NIXL notifications (which CURVE cannot cover), and it costs one small
hash per frame. Confidentiality is out of scope: encrypt the network (WireGuard, IPsec, a mesh).

Each kind of frame is signed under its own label (the direction of a side-channel frame, a data
frame, a notification), so a captured frame of one kind is never valid as another. A TCP data
frame's tag covers its header AND its payload bytes, checked before a byte is stored: HMAC-SHA256
rather than keyed BLAKE2b because it is the faster of the two where SHA extensions exist (measured
here: 1.7 GB/s against 0.9 GB/s per core, hashlib releasing the GIL for both), and one primitive
keys every frame. NIXL WRITEs land without a frame to check: their rows are authenticated by the
room MAC (transfer/base.py RoomChecksum, keyed row hashes) that the sender puts in the signed
TransferDone and the receiver checks over the rows as they lie before the room is committed. A
forged payload therefore fails its own room, never lands outside that room's own slots
(transfer/room_rows.py), and is never decoded from.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import msgpack

from ..serving.auth import MAC_BYTES, frame_key, sign, verify

# in-process tests only: serve() refuses to start without the internal token and passes its key
DEV_FRAME_KEY = frame_key("pdserve-development-only-frame-key")
TICKET_BYTES = 16

D2P, P2D = b"pdserve side-channel decode->prefill", b"pdserve side-channel prefill->decode"
DATA, NOTIF = b"pdserve kv data frame", b"pdserve nixl notification"

# the largest side-channel frame (a reservation of thousands of pages, NIXL endpoints)
SIDE_MAX_BYTES = 4 << 20
HEADER_MAX_BYTES = 1 << 20  # the largest data-frame header or notification (run lists)
# A TCP data frame carries at most this many payload bytes and destination runs: a transfer larger
# than that goes as several frames. A receiver takes a whole ZMQ message in before its tag can be
# checked, so this -- not the size of a pool's layer -- bounds what a peer without the key makes
# it hold per connection (issue 40 item 7).
DATA_PAYLOAD_MAX, DATA_RUNS_MAX = 8 << 20, 16384
DATA_FRAME_MAX = DATA_PAYLOAD_MAX + HEADER_MAX_BYTES + 1024
WEDGED_S = 30.0  # a listener loop that has not come round for this long is reported wedged


def new_ticket() -> bytes:
    """128 random bits: a reservation's ticket cannot be guessed from any other."""
    return secrets.token_bytes(TICKET_BYTES)


def unpack(data: bytes, max_bytes: int):
    """msgpack with every length bounded by max_bytes (raises on anything malformed)."""
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=False,
        max_bin_len=max_bytes,
        max_str_len=max_bytes,
        max_array_len=max_bytes,
        max_map_len=max_bytes,
        max_ext_len=0,
    )


def seal_data(key: bytes, header: bytes, payload) -> bytes:
    """A data frame's tag: its header and every payload byte."""
    return sign(key, DATA, header, payload)


def data_ok(key: bytes, header: bytes, payload, tag: bytes) -> bool:
    return verify(key, tag, DATA, header, payload)


def seal_notif(key: bytes, header: bytes) -> bytes:
    """A NIXL notification: the header with its tag as a fixed trailer."""
    return header + sign(key, NOTIF, header)


def open_notif(key: bytes, msg: bytes) -> bytes | None:
    """The notification's header, or None when its trailer does not verify."""
    if not isinstance(msg, bytes) or len(msg) <= MAC_BYTES:
        return None
    header, tag = msg[:-MAC_BYTES], msg[-MAC_BYTES:]
    return header if verify(key, tag, NOTIF, header) else None


@dataclass(frozen=True)
class ListenerStatus:
    """A decode rank's answer to ListenerStatusCmd: its receiving thread's liveness."""

    alive: bool
    problem: str | None  # dead or wedged, said in words; None: receiving
    crashes: int  # frames whose handling raised (caught: the loop went on)


class Liveness:
    """A long-lived listener thread's health: `beat()` once per loop turn; `problem()` says why it is
    dead or wedged (None while fine)."""

    def __init__(self, name: str):
        self.name, self.last = name, time.monotonic()
        self.thread: threading.Thread | None = None
        self.crashes = 0  # frames whose handling raised (caught: the loop goes on)

    def beat(self) -> None:
        self.last = time.monotonic()

    def problem(self) -> str | None:
        if self.thread is None:
            return None
        if not self.thread.is_alive():
            return f"the {self.name} thread is dead"
        stalled = time.monotonic() - self.last
        return (
            f"the {self.name} thread is wedged ({stalled:.0f} s without a turn)"
            if stalled > WEDGED_S
            else None
        )

    def status(self) -> ListenerStatus:
        return ListenerStatus(
            self.thread is not None and self.thread.is_alive(), self.problem(), self.crashes
        )


def cluster_frame_key(token: str | None) -> bytes:
    """The frame key of a server's internal token (serving/auth.load_internal_token), or the
    development key without one (in-process tests only: serve() refuses to start without a token)."""
    return frame_key(token) if token else DEV_FRAME_KEY
