"""model/layers.py `linear`: the few-rows CPU path ((W x^T)^T) equals F.linear up to the order of
the sums, for every row count around its threshold, with and without a bias, on non-contiguous
inputs; other shapes and dtypes go to F.linear unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.layers import FEW_ROWS, SMALL_OUT, linear


@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS, FEW_ROWS + 1, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_in_float64(rows, bias):
    g = torch.Generator().manual_seed(rows)
    out = SMALL_OUT + 32  # a W large enough for the few-rows path
    w = torch.randn(out, 40, dtype=torch.float64, generator=g)
    b = torch.randn(out, dtype=torch.float64, generator=g) if bias else None
    x = torch.randn(rows, 80, dtype=torch.float64, generator=g)[:, ::2]  # non-contiguous rows
    y = linear(x, w, b)
    assert y.shape == (rows, out) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-13, atol=1e-13)


def test_one_row_float32_close_and_other_shapes_unchanged():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(SMALL_OUT + 1, 32, generator=g)
    x = torch.randn(1, 32, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    small = torch.randn(SMALL_OUT, 32, generator=g)  # a small W: F.linear itself, bit for bit
    assert torch.equal(linear(x, small), F.linear(x, small))
    x3 = torch.randn(2, 3, 32, generator=g)  # not [rows, in]: F.linear itself
    assert torch.equal(linear(x3, w), F.linear(x3, w))
    x0 = torch.randn(0, 32, generator=g)
    assert linear(x0, w).shape == (0, SMALL_OUT + 1)
