"""Random and malformed frames for the listener fuzz tests (test_fuzz_listeners.py): random bytes,
random msgpack structures, truncated and bomb-sized msgpack headers, deep nesting, and maps that
look like the protocol's (the right tags and field names) with values of every wrong type."""

from __future__ import annotations

import random

import msgpack

from pdserve.transfer.messages import _SCHEMA

BOMBS = [
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB, no body
    b"\xc6\x7f\xff\xff\xff",  # bin32 of 2 GiB
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G elements
    b"\xdf\xff\xff\xff\xff",  # map32 of 4G pairs
    b"\x91" * 100_000 + b"\xc0",  # 100k nested arrays
    b"\x81\xa1a" * 50_000 + b"\xc0",  # 50k nested maps
    b"\xc7\x05\x01hello",  # an ext type
    b"\xd4\xff\x00",  # a timestamp ext
    b"",
]


def scalar(rng: random.Random):
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            2**31,
            2**63 - 1,
            -(2**63),
            2**64 - 1,
            rng.randint(-(2**40), 2**40),
            0.5,
            float("nan"),
            float("inf"),
            -float("inf"),
            "",
            "x" * rng.randint(0, 300),
            "\u00e9\u4e2d",
            b"",
            rng.randbytes(rng.randint(0, 40)),
            rng.randbytes(16),
        ]
    )


def obj(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.5:
        return scalar(rng)
    if r < 0.75:
        return [obj(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    return {key(rng): obj(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def key(rng: random.Random):
    return rng.choice(
        [
            rng.choice(["room", "ticket", "__type__", "runs", "items", "x"]),
            rng.randint(-5, 5),
            None,
            b"k",
            1.5,
            True,
        ]
    )


def protocol_like(rng: random.Random, fields: dict[str, object]) -> dict:
    """A map with (most of) the given fields, each kept or replaced by a random value, plus maybe a stray one."""
    out = {k: (v if rng.random() < 0.6 else obj(rng)) for k, v in fields.items() if rng.random() < 0.9}
    if rng.random() < 0.2:
        out[key(rng)] = obj(rng)
    return out


def side_message(rng: random.Random) -> dict:
    """A map tagged as one of the side-channel messages, with schema field names and random values."""
    cls = rng.choice(list(_SCHEMA))
    fields = {name: obj(rng) for name in _SCHEMA[cls]}
    return {"__type__": cls.TAG if rng.random() < 0.9 else obj(rng), **protocol_like(rng, fields)}


def body(rng: random.Random, structured) -> bytes:
    """One frame body: random bytes, a bomb, a truncated pack, or a packed structure from `structured`."""
    r = rng.random()
    if r < 0.15:
        return rng.randbytes(rng.randint(0, 200))
    if r < 0.22:
        return rng.choice(BOMBS)
    packed = msgpack.packb(structured(rng) if r < 0.8 else obj(rng), use_bin_type=True)
    return packed[: rng.randint(0, len(packed))] if r > 0.95 else packed
