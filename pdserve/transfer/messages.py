"""Side-channel messages of a KV hand-off and their one msgpack codec.

Every message is a frozen dataclass registered under a type tag. `encode` writes a msgpack map
{"__type__": tag, field: value, ...} (nested messages the same way); `decode` rebuilds the class
from the tag and the field NAMES -- never by position, so adding a field with a default never
shifts another one. Unknown tags and unknown or missing fields are a `ProtocolError`.

Order on the channel (DESIGN.md section 4): decode -> prefill `DecodeReservation` (where each
decode rank wants its rows), prefill -> decode data frames (transfer/tcp.py), then `TransferDone`
LAST (aux: first token, room echo, per-destination checksums, layout echo) or `TransferFailed`.
`Heartbeat`s let either side detect a dead peer. Torch-free: the router may import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

_TAG = "__type__"
_REGISTRY: dict[str, type] = {}


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol."""


class IncompatiblePeer(RuntimeError):
    """The two sides of a hand-off disagree on something that changes the bytes' meaning."""


def message(tag: str):
    """Registers a frozen dataclass under a wire tag."""

    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        if tag in _REGISTRY:
            raise ValueError(f"message tag {tag!r} registered twice")
        cls.TAG = tag
        _REGISTRY[tag] = cls
        return cls

    return wrap


def _tuple(obj, name: str) -> None:
    object.__setattr__(obj, name, tuple(getattr(obj, name)))


@message("fingerprint")
class Fingerprint:
    """What both sides must agree on before a byte is sent (checked in this field order)."""

    model_hash: str
    kv_cache_dtype: str
    model_dtype: str
    page_size: int
    num_layers: int
    dcp_size: int
    index_mode: str

    def check_compatible(self, other: "Fingerprint") -> None:
        """Raises IncompatiblePeer naming the first field that differs and both values."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                raise IncompatiblePeer(f"incompatible peer: {f.name} differs (this side {mine!r}, peer {theirs!r})")


def model_hash(model_dir: str | Path) -> str:
    """sha256 of config.json as canonical JSON (sorted keys, no whitespace): equal configs hash equal
    whatever their formatting."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@message("reservation")
class DecodeReservation:
    room: str
    fingerprint: Fingerprint
    generation: int  # bumped when the decode instance restarts: stale endpoints are never written
    tp_size: int
    dcp_size: int
    page_size: int
    pages: tuple[int, ...]  # global pages reserved for the request (prompt first)
    endpoints: dict[int, str] = field(default_factory=dict)  # decode rank -> "tcp://host:port"
    ticket: int = 0  # unique per reservation: frames of an earlier use of the same room id are dropped

    def __post_init__(self):
        _tuple(self, "pages")
        object.__setattr__(self, "endpoints", {int(k): v for k, v in self.endpoints.items()})


@message("done")
class TransferDone:
    """Aux data, sent after every data frame of the room."""

    room: str
    first_token: int
    checksums: dict[int, int]  # decode rank -> combined checksum of what was sent to it
    fingerprint: Fingerprint  # layout echo: the receiver re-checks it

    def __post_init__(self):
        object.__setattr__(self, "checksums", {int(k): int(v) for k, v in self.checksums.items()})


@message("failed")
class TransferFailed:
    room: str
    reason: str


@message("heartbeat")
class Heartbeat:
    sender: str
    generation: int
    time_s: float


def _to_wire(obj: Any) -> Any:
    if type(obj) in _REGISTRY.values():
        out = {_TAG: obj.TAG}
        for f in dataclasses.fields(obj):
            out[f.name] = _to_wire(getattr(obj, f.name))
        return out
    if isinstance(obj, (list, tuple)):
        return [_to_wire(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, dict) and _TAG in obj:
        tag = obj[_TAG]
        cls = _REGISTRY.get(tag)
        if cls is None:
            raise ProtocolError(f"unknown message type {tag!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        extra = set(obj) - fields - {_TAG}
        if extra:
            raise ProtocolError(f"{tag}: unknown fields {sorted(extra)}")
        try:
            return cls(**{k: _from_wire(v) for k, v in obj.items() if k != _TAG})
        except TypeError as e:
            raise ProtocolError(f"{tag}: {e}") from None
    if isinstance(obj, list):
        return [_from_wire(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _from_wire(v) for k, v in obj.items()}
    return obj


def encode(msg: Any) -> bytes:
    if type(msg) not in _REGISTRY.values():
        raise ProtocolError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)  # int keys: rank -> ...
    except Exception as e:
        raise ProtocolError(f"not a msgpack frame: {e}") from None
    if not (isinstance(obj, dict) and _TAG in obj):
        raise ProtocolError("frame carries no message type tag")
    return _from_wire(obj)
