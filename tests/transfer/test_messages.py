"""Side-channel messages: every message round-trips through the one codec; decoding is by field
name (never position); a fingerprint mismatch names the field and both values."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdserve.transfer.messages import (
    DecodeReservation,
    Fingerprint,
    Heartbeat,
    IncompatiblePeer,
    ProtocolError,
    TransferDone,
    TransferFailed,
    decode,
    encode,
    model_hash,
)

FP = Fingerprint("abc123", "auto", "float64", 16, 4, 2, "split")
MESSAGES = [
    FP,
    DecodeReservation(
        "room-1",
        FP,
        generation=3,
        tp_size=4,
        dcp_size=2,
        page_size=16,
        pages=(5, 1, 9),
        endpoints={0: "tcp://127.0.0.1:5000", 3: "tcp://127.0.0.1:5003"},
        ticket=bytes(range(16)),
    ),
    TransferDone("room-1", first_token=42, checksums={0: 123, 1: 2**32 - 1}, fingerprint=FP),
    TransferFailed("room-1", "bootstrap timeout after 5.0 s"),
    Heartbeat("prefill-0", generation=1, time_s=12.5),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


def test_decode_is_by_name_not_position():
    wire = msgpack.unpackb(encode(MESSAGES[3]), raw=False)
    reordered = {"reason": wire["reason"], "__type__": "failed", "room": wire["room"]}
    assert decode(msgpack.packb(reordered)) == MESSAGES[3]


def test_bad_frames_are_protocol_errors():
    with pytest.raises(ProtocolError, match="unknown message type"):
        decode(msgpack.packb({"__type__": "nope"}))
    with pytest.raises(ProtocolError, match="unknown fields"):
        decode(msgpack.packb({"__type__": "failed", "room": "r", "reason": "x", "extra": 1}))
    with pytest.raises(ProtocolError, match="failed"):
        decode(msgpack.packb({"__type__": "failed", "room": "r"}))
    with pytest.raises(ProtocolError, match="no message type"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError):
        encode({"room": "r"})


def test_fingerprint_mismatch_names_the_field():
    FP.check_compatible(FP)
    changes = [
        ("page_size", 64),
        ("index_mode", "copy"),
        ("model_hash", "zzz"),
        ("kv_cache_dtype", "fp8_e4m3"),
    ]
    for name, value in changes:
        other = dataclasses.replace(FP, **{name: value})
        with pytest.raises(IncompatiblePeer, match=name) as e:
            FP.check_compatible(other)
        assert repr(getattr(FP, name)) in str(e.value) and repr(value) in str(e.value)


def test_model_hash_ignores_formatting(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "config.json").write_text('{"x": 1, "y": [1, 2]}')
    (tmp_path / "b" / "config.json").write_text('{\n  "y": [1,2],\n  "x": 1\n}')
    assert model_hash(tmp_path / "a") == model_hash(tmp_path / "b")
