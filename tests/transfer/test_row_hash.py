"""The room MAC's row hashes (transfer/row_mac.py: Toeplitz NH over each row's bytes) by
native/rowhash.c and by torch's form equal the definition over Python integers, for every layout
row_macs is given: dtypes of 1, 2, 4 and 8 bytes, widths that are not a multiple of 8 bytes (the zero
padding) or leave a tail after the 32-byte vectors, rows strided in the pool, odd addresses, the
extreme words (every carry of the 32-bit adds and the 64-bit sums), rows wider than a torch-form
block, and more rows than one thread's grain."""

from __future__ import annotations

import struct

import pytest
import torch

from pdserve.native import ops as native
from pdserve.transfer import row_mac
from pdserve.transfer.frames import DEV_FRAME_KEY
from pdserve.transfer.row_mac import LANES, SHIFT, _bytes, _key, row_macs

KEY = DEV_FRAME_KEY
M32, M64 = (1 << 32) - 1, (1 << 64) - 1
built = pytest.mark.skipif(
    native.status().startswith("unavailable"), reason=f"the native kernel is {native.status()}"
)


def torch_form(rows: torch.Tensor, monkeypatch, key: bytes = KEY) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(row_mac.native, "row_hash", lambda b, k: None)
        return row_macs(key, rows)


def nh(key: bytes, row: bytes) -> list[int]:
    """The definition over Python integers: per lane the NH sum mod 2^64, as a signed int64."""
    padded = row + bytes(-len(row) % 8)
    m = struct.unpack(f"<{len(padded) // 4}I", padded)
    k = [x & M32 for x in _key(key, len(row)).tolist()]
    out = []
    for lane in range(LANES):
        kl = k[SHIFT * lane :]
        s = sum(((m[i] + kl[i]) & M32) * ((m[i + 1] + kl[i + 1]) & M32) for i in range(0, len(m), 2)) & M64
        out.append(s - (1 << 64) if s >> 63 else s)
    return out


def python_ints(rows: torch.Tensor, key: bytes = KEY) -> list[list[int]]:
    return [nh(key, bytes(r)) for r in _bytes(rows).tolist()]


def cases():
    g = torch.Generator().manual_seed(5)
    yield "bf16 mla rows", torch.randn(40, 576, generator=g).to(torch.bfloat16)
    yield "fp8 indexer rows", torch.randn(33, 132, generator=g).to(torch.float8_e4m3fn)
    yield "odd bytes", torch.randint(0, 256, (7, 13), dtype=torch.uint8, generator=g)
    yield "float64", torch.randn(5, 9, dtype=torch.float64, generator=g)
    yield "one row", torch.randn(1, 3, generator=g)
    yield "tails", torch.randn(6, 11, generator=g).to(torch.bfloat16)  # 22 bytes: a tail, padded
    pool = torch.randn(20, 2, 300, generator=g).to(torch.bfloat16)
    yield "pool rows (strided)", pool[3:17:2, 1]
    buf = torch.zeros(4 * 128 + 3, dtype=torch.uint8)
    odd = buf[3:].view(4, 128)
    odd.copy_(torch.randint(0, 256, (4, 128), dtype=torch.uint8, generator=g))
    yield "odd address", odd
    yield "extreme words", torch.tensor([[255] * 72, [0] * 72, [255, 0] * 36], dtype=torch.uint8)


@built
@pytest.mark.parametrize("name,rows", list(cases()), ids=[c[0] for c in cases()])
def test_native_row_hashes_equal_torch_and_the_definition(name, rows, monkeypatch):
    b = _bytes(rows)
    assert native.row_hash(b, _key(KEY, b.shape[1])) is not None, "the kernel did not run"
    got = row_macs(KEY, rows)
    assert got.dtype == torch.int64 and got.shape == (len(rows), LANES)
    assert torch.equal(got, torch_form(rows, monkeypatch))
    assert got.tolist() == python_ints(rows)


def test_torch_form_on_wide_rows_and_more_rows_than_a_block(monkeypatch):
    """A wide row whose sums wrap many times; many narrow rows taken a block of rows at a time."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 256, (2, (1 << 17) + 21), dtype=torch.uint8, generator=g)
    wide[0].fill_(255)  # every product and sum at its largest
    assert torch_form(wide, monkeypatch).tolist() == python_ints(wide)
    many = torch.randint(0, 256, (row_mac.BLOCK_BYTES // 24 + 7, 24), dtype=torch.uint8, generator=g)
    want = torch_form(many, monkeypatch)
    assert want[-5:].tolist() == python_ints(many[-5:])
    if not native.status().startswith("unavailable"):
        assert torch.equal(row_macs(KEY, many), want) and torch.equal(
            row_macs(KEY, wide), torch_form(wide, monkeypatch)
        )


def test_a_changed_byte_changes_every_lane_and_the_key_matters(monkeypatch):
    rows = torch.randint(0, 256, (3, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    base = row_macs(KEY, rows)
    for at in (0, 1, 17, 39):
        changed = rows.clone()
        changed[1, at] ^= 0x10
        h = row_macs(KEY, changed)
        assert torch.equal(h[[0, 2]], base[[0, 2]]) and bool((h[1] != base[1]).all()), at
    assert bool((row_macs(bytes(32), rows) != base).all())
    assert row_macs(bytes(32), rows).tolist() == python_ints(rows, bytes(32))


@built
def test_many_rows_on_two_threads_equal_one(monkeypatch):
    """Above the grain the rows are split over OpenMP threads: the same hashes."""
    rows = torch.randn(4096, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = row_macs(KEY, rows)
        torch.set_num_threads(1)
        one = row_macs(KEY, rows)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one[::512], torch_form(rows[::512], monkeypatch))


@built
def test_layouts_the_kernel_refuses_fall_back():
    b = torch.zeros(3, 8, dtype=torch.uint8)
    k = _key(KEY, 8)
    assert native.row_hash(b.view(torch.int16), k) is None  # not bytes
    assert native.row_hash(b, k[:4]) is None  # a key of another length
    assert native.row_hash(b.t(), _key(KEY, 3)) is None  # bytes not contiguous
    assert native.row_hash(b, k.to(torch.int64)) is None


# ---- the fold: one stream's row hashes -> its 63-bit MAC -----------------------------------------------
def fold_definition(key: bytes, hashes: list[list[int]]) -> int:
    """row_mac.fold over Python integers: BLAKE2b(key) over the row count and the NH lanes of each
    block of FOLD_ROWS hashes (16 little-endian bytes each), the last block shorter, under the fold key."""
    import hashlib

    data = b"".join(struct.pack("<qq", *h) for h in hashes)
    width = row_mac.FOLD_ROWS * 16
    mac = hashlib.blake2b(key=key, digest_size=8, person=b"pdserve stream")
    mac.update(len(hashes).to_bytes(8, "little"))
    for at in range(0, len(data), width):
        mac.update(struct.pack("<qq", *nh(row_mac._fold_key(key), data[at : at + width])))
    return int.from_bytes(mac.digest(), "little") & ((1 << 63) - 1)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200])
def test_the_fold_equals_its_definition_and_not_how_the_hashes_are_cut(n, monkeypatch):
    g = torch.Generator().manual_seed(n)
    hashes = torch.randint(-(1 << 63), (1 << 63) - 1, (n, LANES), dtype=torch.int64, generator=g)
    want = fold_definition(KEY, hashes.tolist())
    assert row_mac.fold(KEY, [hashes]) == want
    assert row_mac.fold(KEY, [hashes[:1], hashes[1:70], hashes[70:]]) == want
    assert row_mac.fold(KEY, list(hashes.split(7))) == want
    with monkeypatch.context() as m:  # torch's form of the second level (a GPU's)
        m.setattr(row_mac.native, "row_hash", lambda b, k: None)
        assert row_mac.fold(KEY, [hashes]) == want


def test_the_fold_sees_every_hash_the_count_and_the_key():
    hashes = torch.randint(
        -(1 << 40), 1 << 40, (130, LANES), dtype=torch.int64, generator=torch.Generator().manual_seed(4)
    )
    want = row_mac.fold(KEY, [hashes])
    for row, lane in ((0, 0), (63, 1), (64, 0), (129, 1)):  # first / last of a full block, the tail
        changed = hashes.clone()
        changed[row, lane] ^= 1 << 33
        assert row_mac.fold(KEY, [changed]) != want, (row, lane)
    swapped = hashes[[1, 0] + list(range(2, 130))]
    assert row_mac.fold(KEY, [swapped]) != want
    zero_row = torch.zeros(1, LANES, dtype=torch.int64)  # an all-zero hash padded on: another count
    short = hashes[:127]
    assert row_mac.fold(KEY, [short, zero_row]) != row_mac.fold(KEY, [short])
    assert row_mac.fold(bytes(32), [hashes]) != want
    assert row_mac.fold(KEY, []) == fold_definition(KEY, []) != row_mac.fold(KEY, [zero_row])
