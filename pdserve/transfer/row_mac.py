"""Keyed row hashes: what a hand-off's room MAC (transfer/base.py `RoomChecksum`) runs over.

Per row of a [n, width] tensor, two hashes sum_j k_j * w_j mod P (P = 2^31 - 1) over the row's 16-bit
words w_j, with secret coefficients k_j drawn from the cluster frame key (SHAKE-256): a polynomial
universal hash (Carter-Wegman). For any two different rows, the chance over the key that one hash
agrees is 1/P, both: ~2^-62; an attacker who does not hold the key cannot make a changed row keep
its hashes, whatever he knows of the rows (the +d / -d edits that keep a wrapping int64 sum change
them). The hashes never travel: RoomChecksum folds them, in the rows' order, into a keyed BLAKE2b.

Vectorised torch on the rows' own device (a GPU hashes VRAM rows there, no host copy), and
independent of how rows are cut into frames or chunks: a sender and a receiver that split a stream
differently hash it alike.
"""

from __future__ import annotations

import functools
import hashlib

import torch

P = (1 << 31) - 1
LANES = 2  # independent hashes per row
BLOCK_WORDS = 1 << 22  # rows are hashed in blocks of about this many words (bounds the int64 temporary)


@functools.lru_cache(maxsize=64)
def _coefficients(key: bytes, words: int, device: str) -> torch.Tensor:
    """[LANES, words] int64 in [0, P), from the key alone (the same on every rank)."""
    raw = hashlib.shake_256(b"pdserve row mac v1" + key + words.to_bytes(8, "little")).digest(
        4 * LANES * words
    )
    k = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) & 0x7FFFFFFF
    return torch.remainder(k, P).view(LANES, words).to(device)


def row_macs(key: bytes, rows: torch.Tensor) -> torch.Tensor:
    """[n, LANES] int64 keyed hashes of the n rows of `rows` ([n, ...], any dtype of even row bytes),
    on the rows' device."""
    b = rows.reshape(len(rows), -1).contiguous().view(torch.uint8)
    if b.shape[1] % 2:
        b = torch.nn.functional.pad(b, (0, 1))
    if b.numel() == 0:
        return torch.zeros(len(b), LANES, dtype=torch.int64, device=b.device)
    if b.data_ptr() % 2:
        b = b.clone()
    w = b.view(torch.int16)
    k = _coefficients(key, w.shape[1], str(w.device))
    step = max(1, BLOCK_WORDS // w.shape[1])
    out = torch.empty(len(w), LANES, dtype=torch.int64, device=w.device)
    for i in range(0, len(w), step):
        block = w[i : i + step].to(torch.int64)
        for lane in range(LANES):
            # |w| < 2^15, k < 2^31: each product < 2^46; reduced first when a row could overflow int64
            prod = block * k[lane]
            if w.shape[1] > 1 << 16:
                prod = torch.remainder(prod, P)
            out[i : i + step, lane] = torch.remainder(prod.sum(1), P)
    return out
