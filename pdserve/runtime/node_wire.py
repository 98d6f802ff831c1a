"""The node link: the control path between a multi-node instance's leader and its node agents
(runtime/node_group.py, runtime/node_agent.py). docs/design.md invariant 11: this port is a trust
boundary like every other.

- Transport: one TCP connection per agent, opened by the agent to the leader (--dist-addr's port + 1).
- Handshake: the leader sends a 32-byte nonce, the agent its own and a proof (HMAC under the link
  key, a key derived from the cluster frame key, so from the internal token), the leader its proof;
  both then key the session with both nonces. A peer without the token learns nothing and gets
  no further than 64 bytes read within HANDSHAKE_S.
- Frames: [length: 8 bytes][tag: 32 bytes][payload]; the tag is an HMAC under the session key over
  the direction and a per-direction sequence number and the payload, so a frame can be neither
  forged, replayed, reordered nor reflected. The length is checked against MAX_FRAME before the
  payload is read, the tag before it is decoded.
- Messages: the typed dataclasses below. Payloads hold the ranks' own typed commands and replies
  (dataclasses with tensors), pickled; decoding allows only pdserve's dataclasses, enums and rank
  workers, a few plain builtins and torch's dtype / Size / device: every tensor and array crosses
  as (dtype, shape, bytes), so no unpickling code of torch or numpy runs on this path.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import importlib
import io
import pickle
import secrets
import socket
import threading
from dataclasses import dataclass
from typing import Any

from ..serving.auth import sign, verify

MAX_FRAME = 256 << 20  # bytes of one message (a command, or one node's replies)
HANDSHAKE_S = 5.0
NONCE = 32
TAG = 32


class LinkError(ConnectionError):
    """The link closed, timed out, or a peer failed authentication or sent a bad frame."""


# --- messages -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    node_rank: int
    nnodes: int
    role: str  # "prefill" | "decode": an agent joins only a leader of its role


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Start:
    generation: int
    factory: type  # the rank worker class
    payload: Any  # its config (the agent puts its own frame key and node-local fields in)
    launch: Any  # the instance's LaunchConfig (the agent sets its node_rank)


@dataclass(frozen=True)
class Ready:
    generation: int
    infos: list  # per rank of the node, its readiness info
    pids: list[int]


@dataclass(frozen=True)
class Failed:
    generation: int
    message: str  # a rank did not start, died, or the node's group broke


@dataclass(frozen=True)
class Command:
    generation: int
    seq: int
    cmd: Any
    timeout_s: float


@dataclass(frozen=True)
class Replies:
    generation: int
    seq: int
    replies: list  # per rank of the node (None where it raised)
    errors: dict[int, str]  # global rank -> traceback


@dataclass(frozen=True)
class Beat:
    generation: int
    dead: str | None = None  # the agent's: why one of its ranks is gone


@dataclass(frozen=True)
class Stop:
    generation: int


# --- codec ----------------------------------------------------------------------------------------


def _tensor(dtype: str, shape: tuple, data: bytes):
    import torch

    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).view(shape)


def _array(dtype: str, shape: tuple, data: bytes):
    import numpy as np

    return np.frombuffer(bytearray(data), dtype=np.dtype(dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        mod = type(obj).__module__
        if mod == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b""
            return _tensor, (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
        if mod == "numpy" and type(obj).__name__ == "ndarray":
            if obj.dtype.hasobject:
                raise pickle.PicklingError("object arrays do not cross the node link")
            return _array, (obj.dtype.str, obj.shape, obj.tobytes())
        return NotImplemented


_BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray"}
_OWN = {"_tensor": _tensor, "_array": _array}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == __name__ and name in _OWN:
            return _OWN[name]
        if module == "builtins" and name in _BUILTINS:
            return getattr(__import__("builtins"), name)
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module == "torch":
            import torch

            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype) or obj in (torch.Size, torch.device):
                return obj
        if module.split(".")[0] == "pdserve" and "." in module:
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module and _safe_class(obj):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} may not cross the node link")


def _safe_class(cls: type) -> bool:
    """Classes whose instances are rebuilt from data alone: dataclasses, enums, named tuples, and
    rank worker classes (passed, never instantiated, by the unpickler)."""
    from .launcher import RankWorker

    return (
        dataclasses.is_dataclass(cls)
        or issubclass(cls, enum.Enum)
        or (issubclass(cls, tuple) and hasattr(cls, "_fields"))
        or issubclass(cls, RankWorker)
    )


def dumps(msg: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


# --- the link -------------------------------------------------------------------------------------


def link_key(frame_key: bytes) -> bytes:
    return hmac.new(frame_key, b"pdserve node link v1", hashlib.sha256).digest()


class Link:
    """One authenticated connection; send() is thread-safe, recv() is for one reader thread."""

    def __init__(self, sock: socket.socket, session: bytes, out_label: bytes, in_label: bytes, peer: str):
        self.sock, self.session, self.peer = sock, session, peer
        self.out_label, self.in_label = out_label, in_label
        self.out_seq = self.in_seq = 0
        self._lock = threading.Lock()
        sock.settimeout(None)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a command is one small write

    def send(self, msg: Any) -> None:
        payload = dumps(msg)
        if len(payload) > MAX_FRAME:
            raise LinkError(f"a {type(msg).__name__} of {len(payload)} bytes exceeds the link's {MAX_FRAME}")
        with self._lock:
            tag = sign(self.session, self.out_label, self.out_seq.to_bytes(8, "little"), payload)
            self.out_seq += 1
            try:
                self.sock.sendall(len(payload).to_bytes(8, "little") + tag + payload)
            except OSError as e:
                raise LinkError(f"sending to {self.peer}: {e}") from None

    def recv(self) -> Any:
        head = _read(self.sock, 8 + TAG, self.peer)
        n = int.from_bytes(head[:8], "little")
        if n > MAX_FRAME:
            raise LinkError(f"{self.peer} announced a frame of {n} bytes (limit {MAX_FRAME})")
        payload = _read(self.sock, n, self.peer)
        if not verify(self.session, head[8:], self.in_label, self.in_seq.to_bytes(8, "little"), payload):
            raise LinkError(f"{self.peer} sent a frame that fails authentication")
        self.in_seq += 1
        try:
            return loads(payload)
        except Exception as e:  # authenticated but undecodable: a bug or a version mismatch
            raise LinkError(f"{self.peer} sent an undecodable message: {e}") from None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _read(sock: socket.socket, n: int, peer: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except (OSError, socket.timeout) as e:
            raise LinkError(f"reading from {peer}: {e}") from None
        if not chunk:
            raise LinkError(f"{peer} closed the link")
        buf += chunk
    return bytes(buf)


def accept_link(sock: socket.socket, key: bytes, peer: str) -> Link:
    """The leader's side of the handshake on an accepted connection (LinkError if the peer fails it)."""
    sock.settimeout(HANDSHAKE_S)
    ours = secrets.token_bytes(NONCE)
    try:
        sock.sendall(ours)
    except OSError as e:
        raise LinkError(f"{peer}: {e}") from None
    got = _read(sock, NONCE + TAG, peer)
    theirs, proof = got[:NONCE], got[NONCE:]
    if not verify(key, proof, b"agent", ours, theirs):
        raise LinkError(f"{peer} failed the node link's authentication (another internal token?)")
    try:
        sock.sendall(sign(key, b"leader", ours, theirs))
    except OSError as e:
        raise LinkError(f"{peer}: {e}") from None
    return Link(sock, sign(key, b"session", ours, theirs), b"leader->agent", b"agent->leader", peer)


def connect_link(host: str, port: int, key: bytes, timeout_s: float = HANDSHAKE_S) -> Link:
    """The agent's side: connects to the leader and authenticates both ways (LinkError / OSError)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    peer = f"the leader at {host}:{port}"
    try:
        sock.settimeout(HANDSHAKE_S)
        theirs = _read(sock, NONCE, peer)
        ours = secrets.token_bytes(NONCE)
        sock.sendall(ours + sign(key, b"agent", theirs, ours))
        try:
            proof = _read(sock, TAG, peer)
        except LinkError:  # the leader hangs up on a proof it cannot verify
            raise LinkError(f"{peer} refused this node's authentication (another internal token?)") from None
        if not verify(key, proof, b"leader", theirs, ours):
            raise LinkError(f"{peer} failed the node link's authentication (another internal token?)")
    except BaseException:
        sock.close()
        raise
    return Link(sock, sign(key, b"session", theirs, ours), b"agent->leader", b"leader->agent", peer)
