"""Side-channel messages of a KV hand-off and their one msgpack codec.

Every message is a frozen dataclass registered under a type tag. `encode` writes a msgpack map
{"__type__": tag, field: value, ...} (nested messages the same way); `decode` rebuilds the class
from the tag and the field NAMES -- never by position, so adding a field with a default never
shifts another one. Unknown tags and unknown or missing fields are a `ProtocolError`.

Order on the channel (docs/design.md section 4): decode -> prefill `DecodeReservation` (where each
decode rank wants its rows), prefill -> decode data frames (transfer/tcp.py), then `TransferDone`
LAST (aux: first token, room echo, per-destination checksums, layout echo) or `TransferFailed`.
`Heartbeat`s let either side detect a dead peer. `Hello` / `Welcome` open a side channel: a decode
client sends nothing else (no reservation, so no endpoint or NIXL agent metadata) before the peer
proved it holds the cluster key (transfer/side_channel.py).

`decode` checks every field's type and size against the class's schema and raises ProtocolError --
and nothing else -- for any input whatsoever (tests/transfer/test_fuzz_listeners.py fuzzes it).
Frames are authenticated before they get here (transfer/frames.py). Torch-free: the router may
import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from .frames import SIDE_MAX_BYTES, TICKET_BYTES, unpack

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
                raise IncompatiblePeer(
                    f"incompatible peer: {f.name} differs (this side {mine!r}, peer {theirs!r})"
                )


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
    ticket: bytes = b""  # 128 random bits per reservation (frames.new_ticket): frames of an earlier use
    # of the same room id, or of another room, are dropped
    cached_len: int = 0  # leading prompt tokens the decode instance already holds (its prefix cache,
    # whole pages): the prefill sends only positions [cached_len, prompt_len)

    def __post_init__(self):
        _tuple(self, "pages")
        object.__setattr__(self, "endpoints", {int(k): v for k, v in self.endpoints.items()})


@message("done")
class TransferDone:
    """Aux data, sent after every data frame of the room."""

    room: str
    first_token: int
    checksums: dict[int, int]  # decode rank -> room MAC of what was sent to it (base.RoomChecksum)
    fingerprint: Fingerprint  # layout echo: the receiver re-checks it
    ticket: bytes = b""  # the reservation's (stamped by BootstrapServer.reply): an outcome of an earlier
    # use of the room id never counts for a later one
    first_logprob: list = dataclasses.field(default_factory=list)  # [] or [logprob, [[id, logprob], ...]]:
    # the first token's logprobs when the request asked for them (request.py TokenLogprob)
    more_first: list = dataclasses.field(default_factory=list)  # n > 1: [[token, first_logprob], ...] of
    # choices 1..n-1, each sampled from the same logits with its own seed stream

    def __post_init__(self):
        object.__setattr__(self, "checksums", {int(k): int(v) for k, v in self.checksums.items()})


MAX_REASON = 4096  # longer failure reasons are cut (a frame must stay decodable)


@message("failed")
class TransferFailed:
    room: str
    reason: str
    ticket: bytes = b""  # the reservation's, as in TransferDone (b"": a room that was never reserved)
    quiesced: bool = True  # from a prefill: every rank's sends for the room returned (False: a rank
    # failed mid-send, so others may still WRITE; the decode side holds the room's pages)

    def __post_init__(self):
        if isinstance(self.reason, str) and len(self.reason) > MAX_REASON:
            object.__setattr__(self, "reason", self.reason[: MAX_REASON - 3] + "...")


@message("heartbeat")
class Heartbeat:
    sender: str
    generation: int
    time_s: float


@message("hello")
class Hello:
    """decode -> prefill: the first frame of a client; the nonce is fresh per client."""

    nonce: bytes


@message("welcome")
class Welcome:
    """prefill -> decode: the client's nonce back, under the prefill->decode label: the peer holds the key."""

    nonce: bytes


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


MAX_ROOM, MAX_NAME, MAX_ENDPOINT = 1024, 1024, 1 << 20
MAX_PAGES, MAX_RANKS = 1 << 20, 4096
INT64 = 1 << 63


def _fail(what: str):
    raise ProtocolError(what)


def _int(lo: int = -INT64, hi: int = INT64) -> Callable:
    def check(v, name):
        if type(v) is not int or not lo <= v < hi:
            _fail(f"{name}: expected an integer in [{lo}, {hi}), got {type(v).__name__}")
        return v

    return check


def _str(max_len: int) -> Callable:
    def check(v, name):
        if type(v) is not str or len(v) > max_len:
            _fail(f"{name}: expected a string of at most {max_len} characters")
        return v

    return check


def _bytes(size: int) -> Callable:
    def check(v, name):
        if type(v) is not bytes or len(v) != size:
            _fail(f"{name}: expected {size} bytes")
        return v

    return check


def _float(v, name):
    if type(v) not in (int, float) or not math.isfinite(v):
        _fail(f"{name}: expected a finite number")
    return v


def _pages(v, name):
    if type(v) is not list or len(v) > MAX_PAGES:
        _fail(f"{name}: expected a list of at most {MAX_PAGES} pages")
    page = _int(0, 1 << 40)
    return tuple(page(p, name) for p in v)


def _rank_map(value: Callable) -> Callable:
    def check(v, name):
        if type(v) is not dict or len(v) > MAX_RANKS:
            _fail(f"{name}: expected a map of at most {MAX_RANKS} ranks")
        rank = _int(0, MAX_RANKS)
        return {rank(k, name): value(x, name) for k, x in v.items()}

    return check


def _nested(cls) -> Callable:
    def check(v, name):
        if type(v) is not dict or v.get(_TAG) != cls.TAG:
            _fail(f"{name}: expected a {cls.TAG} message")
        return _build(cls, v)

    return check


def _bool(v, name):
    if type(v) is not bool:
        _fail(f"{name}: expected a boolean")
    return v


MAX_TOP_LOGPROBS = 20


def _token_pairs(v, name: str, most: int, what: str, check_second: Callable) -> list:
    """A list of at most `most` [token id, x] pairs, each x passing `check_second`."""
    if type(v) is not list or len(v) > most:
        _fail(f"{name}: expected at most {most} {what}, each [token id, logprob]")
    for pair in v:
        if type(pair) is not list or len(pair) != 2:
            _fail(f"{name}: {what} are [token id, logprob]")
        _int(0, 1 << 32)(pair[0], name)
        check_second(pair[1], name)
    return v


def _logprob(v, name):
    """[] or [logprob, [[token id, logprob], ...]] (at most MAX_TOP_LOGPROBS pairs)."""
    if type(v) is not list or len(v) not in (0, 2):
        _fail(f"{name}: expected [] or [logprob, top]")
    if v:
        _float(v[0], name)
        _token_pairs(v[1], name, MAX_TOP_LOGPROBS, "top entries", _float)
    return v


MAX_CHOICES = 128


def _more_first(v, name):
    """[[token, logprob wire], ...]: at most MAX_CHOICES - 1 other choices' first tokens."""
    return _token_pairs(v, name, MAX_CHOICES - 1, "other choices", _logprob)


def _ticket(v, name):
    if type(v) is not bytes or len(v) not in (0, TICKET_BYTES):
        _fail(f"{name}: expected {TICKET_BYTES} bytes")
    return v


_SCHEMA: dict[type, dict[str, Callable]] = {
    Fingerprint: {
        "model_hash": _str(256),
        "kv_cache_dtype": _str(64),
        "model_dtype": _str(64),
        "page_size": _int(1, 1 << 20),
        "num_layers": _int(1, 1 << 16),
        "dcp_size": _int(1, MAX_RANKS),
        "index_mode": _str(64),
    },
    DecodeReservation: {
        "room": _str(MAX_ROOM),
        "fingerprint": _nested(Fingerprint),
        "generation": _int(),
        "tp_size": _int(1, MAX_RANKS),
        "dcp_size": _int(1, MAX_RANKS),
        "page_size": _int(1, 1 << 20),
        "pages": _pages,
        "endpoints": _rank_map(_str(MAX_ENDPOINT)),
        "ticket": _bytes(TICKET_BYTES),
        "cached_len": _int(0, 1 << 40),
    },
    TransferDone: {
        "room": _str(MAX_ROOM),
        "first_token": _int(0, 1 << 32),
        "checksums": _rank_map(_int(0, INT64)),
        "fingerprint": _nested(Fingerprint),
        "ticket": _ticket,
        "first_logprob": _logprob,
        "more_first": _more_first,
    },
    TransferFailed: {
        "room": _str(MAX_ROOM),
        "reason": _str(MAX_REASON),
        "ticket": _ticket,
        "quiesced": _bool,
    },
    Heartbeat: {"sender": _str(MAX_NAME), "generation": _int(), "time_s": _float},
    Hello: {"nonce": _bytes(16)},
    Welcome: {"nonce": _bytes(16)},
}


def _build(cls, obj: dict) -> Any:
    """The message of class cls from its wire map: every field named, typed and sized by the schema."""
    schema = _SCHEMA[cls]
    names = set(obj) - {_TAG}
    if not all(type(k) is str for k in names):
        _fail(f"{cls.TAG}: field names must be strings")
    if names - set(schema):
        _fail(f"{cls.TAG}: unknown fields {sorted(names - set(schema))}")
    required = {
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    if required - names:
        _fail(f"{cls.TAG}: missing fields {sorted(required - names)}")
    return cls(**{k: schema[k](obj[k], f"{cls.TAG}.{k}") for k in names})


def encode(msg: Any) -> bytes:
    if type(msg) not in _REGISTRY.values():
        raise ProtocolError(f"{type(msg).__name__} is not a registered message")
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    """The message of one frame; ProtocolError -- and no other exception -- for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > SIDE_MAX_BYTES:
        raise ProtocolError("not a frame of at most SIDE_MAX_BYTES bytes")
    try:
        obj = unpack(data, SIDE_MAX_BYTES)  # int keys: rank -> ...
    except Exception as e:
        raise ProtocolError(f"not a msgpack frame: {type(e).__name__}") from None
    if not (type(obj) is dict and _TAG in obj):
        raise ProtocolError("frame carries no message type tag")
    tag = obj[_TAG]
    cls = _REGISTRY.get(tag) if type(tag) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(tag)[:64]!r}")
    try:
        return _build(cls, obj)
    except ProtocolError:
        raise
    except Exception as e:  # a value the dataclass itself refuses: still only a protocol error
        raise ProtocolError(f"{tag}: {type(e).__name__}: {e}"[:512]) from None


@functools.cache
def _prefixes() -> tuple[bytes, ...]:
    """How every registered message's frame begins: its map header, then its type tag."""
    out, tag = [], msgpack.packb(_TAG)
    for cls in _REGISTRY.values():
        b = msgpack.packb({_TAG: cls.TAG, **{f.name: None for f in dataclasses.fields(cls)}})
        out.append(b[: b.index(tag) + len(tag) + len(msgpack.packb(cls.TAG))])
    return tuple(out)


def looks_like_message(frame: bytes) -> bool:
    """A cheap screen before a frame's HMAC: it starts as one of the registered messages."""
    return frame.startswith(_prefixes())
