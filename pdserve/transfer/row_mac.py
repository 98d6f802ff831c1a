"""Keyed row hashes: what a hand-off's room MAC (transfer/base.py `RoomChecksum`) runs over.

Per row of a [n, ...] tensor, LANES Toeplitz NH hashes (the inner hash of UMAC, Black et al. 1999)
over the row's bytes: the row of L bytes, zero-padded to a multiple of 8, read as little-endian
32-bit words m_0, m_1, ..., gives for lane l

    sum_i ((m_2i + k_(SHIFT l + 2i)) mod 2^32) * ((m_2i+1 + k_(SHIFT l + 2i+1)) mod 2^32)   mod 2^64

with secret 32-bit key words k drawn from the cluster frame key and L (SHAKE-256), so rows of
different lengths have unrelated keys. NH is 2^-32-almost-universal over rows of one length, and
Toeplitz lanes (each lane's key the last one's shifted by SHIFT words, 16 bytes, as RFC 4418's
L1-HASH shifts its NH keys) multiply: two different rows of one length keep both lanes with chance
at most 2^-64 over the key, whatever an attacker without the key knows of them (the +d / -d edits
that kept a wrapping sum of the words change them). The hashes never travel: RoomChecksum folds
them, in the rows' order, with `fold`: the same NH once more, over blocks of FOLD_ROWS row hashes
under a second key, then a keyed BLAKE2b over the row count and the block hashes (UMAC's shape: a
universal hash of a universal hash, then a PRF), so BLAKE2b, the one serial step, reads 1/FOLD_ROWS
of the row hashes.

On a CPU where native/rowhash.c is built (native/ops.py `row_hash`): one add, shift, multiply and
add per 8 bytes and lane in AVX2, read where the rows lie (a pool's strided rows, any address), at
about the memory's rate. Elsewhere (a GPU, PDSERVE_NATIVE=0, no compiler): torch's form below on the
rows' own device (a GPU hashes VRAM rows there, no host copy): int64 products and sums, which wrap
mod 2^64 like NH's (checked once per device). Both equal the definition
over Python integers (tests/transfer/test_row_hash.py) and neither depends on how rows are cut into
frames or chunks: a sender and a receiver that split a stream differently hash it alike.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ..native import ops as native

LANES = native.ROW_HASH_LANES  # Toeplitz NH lanes per row (2)
SHIFT = native.ROW_HASH_SHIFT  # key words between two lanes' keys (4)
FOLD_ROWS = 64  # row hashes per block of the fold's second NH level (1 KB)
BLOCK_BYTES = 1 << 22  # torch's form takes rows in blocks of about this many bytes
M32 = (1 << 32) - 1


@functools.lru_cache(maxsize=64)
def _key(key: bytes, length: int) -> torch.Tensor:
    """[native.row_hash_key_words(length)] int32 key words (their bits are the 32-bit words k) for rows of `length`
    bytes, from the frame key alone (the same on every rank)."""
    raw = hashlib.shake_256(b"pdserve row mac nh v3" + key + length.to_bytes(8, "little")).digest(
        4 * native.row_hash_key_words(length)
    )
    return torch.frombuffer(bytearray(raw), dtype=torch.int32)


@functools.lru_cache(maxsize=64)
def _key64(key: bytes, length: int, device: str) -> torch.Tensor:
    """The same key words as int64 in [0, 2^32), on `device`: torch's form."""
    return (_key(key, length).to(torch.int64) & M32).to(device)


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """rows [n, ...] as [n, L] bytes, each row contiguous; without a copy where the rows already lie
    so (a pool's rows, a chunk's runs)."""
    r = rows.reshape(len(rows), -1)
    if r.shape[1] and r.stride(1) != 1:
        r = r.contiguous()
    return r.view(torch.uint8)


def row_macs(key: bytes, rows: torch.Tensor) -> torch.Tensor:
    """[n, LANES] int64 keyed hashes (the 64-bit sums, two's complement) of the n rows of `rows`
    ([n, ...], any dtype), on the rows' device: by native/rowhash.c on a CPU where it is built, else
    torch's form."""
    b = _bytes(rows)
    if b.numel() == 0:
        return torch.zeros(len(b), LANES, dtype=torch.int64, device=b.device)
    if b.is_cpu and (fast := native.row_hash(b, _key(key, b.shape[1]))) is not None:
        return fast
    return _torch_form(b, _key64(key, b.shape[1], str(b.device)))


def fold(key: bytes, hashes: list[torch.Tensor]) -> int:
    """The keyed MAC (63 bits) of one stream's row hashes, `hashes` its parts ([n_i, LANES] int64,
    any device) in the stream's order; it depends on the sequence only, not on how it is cut.

    The N row hashes, as 16-byte little-endian rows laid end to end, are cut into blocks of
    FOLD_ROWS hashes and a last, shorter block; each block gets NH's LANES hashes under a key of
    its own (the fold key, derived from `key`, and the block's byte length, as `row_macs` keys rows);
    a keyed BLAKE2b then runs over N and those block hashes. Two different sequences of N hashes
    differ in some block, whose NH hashes then agree with chance <= 2^-64 over the fold key (drawn
    apart from the row key, so the hashes it reads do not depend on it); a different N changes
    BLAKE2b's input."""
    mac = hashlib.blake2b(key=key, digest_size=8, person=b"pdserve stream")
    n = sum(len(h) for h in hashes)
    mac.update(n.to_bytes(8, "little"))
    if n:
        h = hashes[0] if len(hashes) == 1 else torch.cat(hashes)
        b = h.to(torch.int64).contiguous().view(torch.uint8).reshape(-1)
        full, width = n // FOLD_ROWS, FOLD_ROWS * 8 * LANES
        parts = [b[: full * width].view(full, width)] if full else []
        if n % FOLD_ROWS:
            parts.append(b[full * width :].view(1, -1))
        for p in parts:
            mac.update(row_macs(_fold_key(key), p).cpu().numpy().tobytes())
    return int63(mac.digest())


def int63(digest: bytes) -> int:
    """A digest's first 8 bytes as a non-negative 63-bit integer (what a MAC travels as)."""
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@functools.lru_cache(maxsize=8)
def _fold_key(key: bytes) -> bytes:
    """The fold's NH key, apart from the row hashes' (`_key` derives words from it as from a frame key)."""
    return hashlib.blake2b(key, digest_size=32, person=b"pdserve nh fold").digest()


def _torch_form(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """NH in int64 tensor ops: each 8-byte pair of words as one int64, split into its two words."""
    _check_wrapping(b.device)
    n, length = b.shape
    pairs = (length + 7) // 8
    step = max(1, BLOCK_BYTES // (8 * pairs))
    buf = torch.zeros(min(step, n), 8 * pairs, dtype=torch.uint8, device=b.device)
    k_lo, k_hi = k[0::2], k[1::2]  # lane l's pairs start SHIFT // 2 pairs after lane l - 1's
    out = torch.empty(n, LANES, dtype=torch.int64, device=b.device)
    for i in range(0, n, step):
        rn = min(step, n - i)
        block = buf[:rn]
        block[:, :length].copy_(b[i : i + rn])  # the columns past the row stay zero: its padding
        p = block.view(torch.int64)  # [rn, pairs]
        lo, hi = p & M32, (p >> 32) & M32
        for lane in range(LANES):
            at = SHIFT // 2 * lane
            a = (lo + k_lo[at : at + pairs]) & M32
            c = (hi + k_hi[at : at + pairs]) & M32
            torch.sum(a * c, 1, out=out[i : i + rn, lane])  # both wrap mod 2^64: NH's own sum
    return out


@functools.lru_cache(maxsize=8)
def _check_wrapping(device: torch.device) -> None:
    """torch's int64 products and sums wrap mod 2^64 (two's complement) on CPUs and CUDA GPUs, which
    the torch form relies on: checked once per device against Python integers."""
    big = torch.full((1, 3), M32, dtype=torch.int64, device=device)
    got = int((big * big).sum(1).item())
    want = (3 * M32 * M32) % (1 << 64)
    if got % (1 << 64) != want:
        raise RuntimeError(
            f"int64 arithmetic on {device} does not wrap mod 2^64: the room MAC cannot run there"
        )
