"""The room MAC's row hashes by native/rowhash.c equal torch's float64 form (transfer/row_mac.py) and
the polynomial over Python integers, for every layout row_macs is given: dtypes of 1, 2, 4 and 8
bytes, odd byte widths, rows strided in the pool, an odd address, the extreme words (sign), widths
that leave a tail after the 8-word vectors, and more rows than one thread's grain."""

from __future__ import annotations

import pytest
import torch

from pdserve.native import ops as native
from pdserve.transfer import row_mac
from pdserve.transfer.frames import DEV_FRAME_KEY
from pdserve.transfer.row_mac import P, _coefficients, _int_coefficients, _words, row_macs

pytestmark = pytest.mark.skipif(
    native.status().startswith("unavailable"), reason=f"the native kernel is {native.status()}"
)
KEY = DEV_FRAME_KEY


def torch_form(rows: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(row_mac.native, "row_hash", lambda w, k: None)
        return row_macs(KEY, rows)


def python_ints(rows: torch.Tensor) -> list[list[int]]:
    w = _words(rows).tolist()
    k = _coefficients(KEY, len(w[0]), "cpu").to(torch.int64).tolist()
    return [[sum(a * b for a, b in zip(lane, r)) % P for lane in k] for r in w]


def cases():
    g = torch.Generator().manual_seed(5)
    yield "bf16 mla rows", torch.randn(40, 576, generator=g).to(torch.bfloat16)
    yield "fp8 indexer rows", torch.randn(33, 132, generator=g).to(torch.float8_e4m3fn)
    yield "odd bytes", torch.randint(0, 256, (7, 13), dtype=torch.uint8, generator=g)
    yield "float64", torch.randn(5, 9, dtype=torch.float64, generator=g)
    yield "one row", torch.randn(1, 3, generator=g)
    yield "tails", torch.randn(6, 11, generator=g).to(torch.bfloat16)  # 11 words: 8 + 3
    pool = torch.randn(20, 2, 300, generator=g).to(torch.bfloat16)
    yield "pool rows (strided)", pool[3:17:2, 1]
    buf = torch.zeros(4 * 64 * 2 + 1, dtype=torch.uint8)
    odd = buf[1:].view(4, 128)
    odd.copy_(torch.randint(0, 256, (4, 128), dtype=torch.uint8, generator=g))
    yield "odd address", odd
    yield "extreme words", torch.tensor([[-32768] * 20, [32767] * 20, [-1, 1] * 10], dtype=torch.int16)


@pytest.mark.parametrize("name,rows", list(cases()), ids=[c[0] for c in cases()])
def test_native_row_hashes_equal_torch_and_the_polynomial(name, rows, monkeypatch):
    w = _words(rows)
    assert native.row_hash(w, _int_coefficients(KEY, w.shape[1])) is not None, "the kernel did not run"
    got = row_macs(KEY, rows)
    assert got.dtype == torch.int64 and got.shape == (len(rows), 3)
    assert torch.equal(got, torch_form(rows, monkeypatch))
    assert got.tolist() == python_ints(rows)


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


def test_layouts_the_kernel_refuses_fall_back():
    w = torch.zeros(3, 8, dtype=torch.int16)
    k = _int_coefficients(KEY, 8)
    assert native.row_hash(w.to(torch.int32), k) is None
    assert native.row_hash(w, k[:, :4]) is None
    assert native.row_hash(w.t(), _int_coefficients(KEY, 3)) is None  # words not contiguous
    assert native.row_hash(w, k.to(torch.int64)) is None
