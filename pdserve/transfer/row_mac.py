"""Keyed row hashes: what a hand-off's room MAC (transfer/base.py `RoomChecksum`) runs over.

Per row of a [n, width] tensor, LANES hashes sum_j k_j * w_j mod P (P = 2^21 - 9, a prime) over the
row's signed 16-bit words w_j, with secret coefficients k_j in [0, P) drawn from the cluster frame
key (SHAKE-256): polynomial universal hashes (Carter-Wegman). For any two different rows the chance
over the key that one lane agrees is 1/P, all three: ~2^-63; an attacker without the key cannot
make a changed row keep its hashes, whatever he knows of the rows (the +d / -d edits that keep a
wrapping int64 sum change them). The hashes never travel: RoomChecksum folds them, in the rows'
order, into a keyed BLAKE2b.

On a CPU where native/rowhash.c is built (native/ops.py `row_hash`): exact int64 sums, read where
the rows lie (a pool's strided rows too), 2-3x torch's form below on one core. Elsewhere (a GPU,
PDSERVE_NATIVE=0, no compiler): one float64 matrix product per block of rows, exact too: |w| < 2^15
and k < 2^21, so every product and every partial sum of at most COLS of them stays an integer below
2^53 (a row of more words is summed COLS words at a time, each part reduced mod P), on the rows' own
device (a GPU hashes VRAM rows there, no host copy). Both equal the Python-int polynomial
(tests/transfer/test_row_hash.py) and neither depends on how rows are cut into frames or chunks: a
sender and a receiver that split a stream differently hash it alike.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from ..native import ops as native

P = (1 << 21) - 9
LANES = 3  # independent hashes per row
COLS = 1 << 16  # words summed exactly in float64 before a reduction
BLOCK_WORDS = 1 << 18  # rows are converted to float64 in blocks of about this many words (2 MB)


@functools.lru_cache(maxsize=64)
def _coefficients(key: bytes, words: int, device: str) -> torch.Tensor:
    """[LANES, words] float64 integers in [0, P), from the key alone (the same on every rank)."""
    raw = hashlib.shake_256(b"pdserve row mac v2" + key + words.to_bytes(8, "little")).digest(
        4 * LANES * words
    )
    k = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) & 0x7FFFFFFF
    return torch.remainder(k, P).view(LANES, words).to(torch.float64).to(device)


@functools.lru_cache(maxsize=64)
def _int_coefficients(key: bytes, words: int) -> torch.Tensor:
    """The same coefficients as [LANES, words] int32 on the CPU: native/rowhash.c's form."""
    return _coefficients(key, words, "cpu").to(torch.int32).contiguous()


def _words(rows: torch.Tensor) -> torch.Tensor:
    """rows [n, ...] as [n, words] signed 16-bit words (a zero byte after an odd row), each row
    contiguous; without a copy where the rows already lie so (a pool's rows, a chunk's runs)."""
    r = rows.reshape(len(rows), -1)
    if r.shape[1] and r.stride(1) != 1:
        r = r.contiguous()
    b = r.view(torch.uint8)
    if b.shape[1] % 2:
        b = torch.nn.functional.pad(b, (0, 1))
    if b.numel() and (b.data_ptr() % 2 or b.stride(0) % 2):  # int16 words need even addresses
        b = torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b)
    return b.view(torch.int16)


def row_macs(key: bytes, rows: torch.Tensor) -> torch.Tensor:
    """[n, LANES] int64 keyed hashes of the n rows of `rows` ([n, ...], any dtype), on the rows'
    device: by native/rowhash.c on a CPU where it is built, else torch's float64 form below."""
    w = _words(rows)
    if w.numel() == 0:
        return torch.zeros(len(w), LANES, dtype=torch.int64, device=w.device)
    if w.is_cpu and (fast := native.row_hash(w, _int_coefficients(key, w.shape[1]))) is not None:
        return fast
    k = _coefficients(key, w.shape[1], str(w.device))
    step = max(1, BLOCK_WORDS // w.shape[1])
    cols = min(COLS, w.shape[1])
    buf = torch.empty(min(step, len(w)), cols, dtype=torch.float64, device=w.device)
    out = torch.zeros(LANES, len(w), dtype=torch.float64, device=w.device)
    for i in range(0, len(w), step):
        n = min(step, len(w) - i)
        for j in range(0, w.shape[1], COLS):
            m = min(COLS, w.shape[1] - j)
            block = buf[:n, :m]
            block.copy_(w[i : i + n, j : j + m])  # copy_ converts at memory speed, .to(float64) does not
            part = torch.remainder(torch.mm(k[:, j : j + m], block.t()), P)  # [LANES, n], exact
            out[:, i : i + n] = torch.remainder(out[:, i : i + n] + part, P)
    return out.t().to(torch.int64)
