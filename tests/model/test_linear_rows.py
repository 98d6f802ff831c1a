"""model/layers.py `linear` where the native few-row kernel is off (a machine that cannot build it;
tests/model/test_native.py covers the kernel and its routing): the few-rows CPU path ((W x^T)^T) equals F.linear up to the order of
the sums, for every row count around its threshold, with and without a bias, on non-contiguous
inputs; with PDSERVE_ONEDNN=1 (opt-in), float32 products of more rows go to oneDNN, and one row
times a float32 W of at least GEMV_MIN_BYTES goes to it by default (PDSERVE_ONEDNN_GEMV=0: off)
(model/kernels.py `matmul_nt` too) and agree with torch's own to float32 rounding; float64 goes to F.linear unchanged."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import kernels, layers
from pdserve.model.kernels import matmul_nt, uses_onednn
from pdserve.model.layers import FEW_ROWS, SMALL_OUT, linear
from pdserve.native import ops as native


@pytest.fixture(autouse=True)
def native_off(monkeypatch):
    """Every test here runs torch's own paths: the native kernel as on a machine without it."""
    monkeypatch.setitem(native._state, "lib", None)
    monkeypatch.setitem(native._state, "status", "off (tests/model/test_linear_rows.py)")


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
    x3 = torch.randn(2, 3, 32, dtype=torch.float64, generator=g)  # not [rows, in]: F.linear itself
    assert torch.equal(linear(x3, w.double()), F.linear(x3, w.double()))
    x0 = torch.randn(0, 32, generator=g)
    assert linear(x0, w).shape == (0, SMALL_OUT + 1)


@pytest.fixture
def onednn_on(monkeypatch):
    """PDSERVE_ONEDNN=1, as an instance started with it runs."""
    if not kernels.ONEDNN_AVAILABLE:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(kernels, "ONEDNN", True)


@pytest.mark.parametrize("shape", [(FEW_ROWS + 1, 48), (300, 48), (4, 5, 48), (3, 600, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_many_float32_rows_take_onednn_and_match(onednn_on, shape, bias):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2]  # non-contiguous rows
    w = torch.randn(SMALL_OUT + 7, shape[-1], generator=g)
    b = torch.randn(SMALL_OUT + 7, generator=g) if bias else None
    assert uses_onednn(x, w)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(linear(x, w, b), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        matmul_nt(x, w), F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-4
    )
    # a non-contiguous right-hand side (attention's values, transposed)
    wt = torch.randn(shape[-1], SMALL_OUT + 7, generator=g).t()
    torch.testing.assert_close(
        matmul_nt(x, wt), F.linear(x.double(), wt.double()).float(), rtol=1e-5, atol=1e-4
    )


def test_what_stays_off_onednn(onednn_on):
    w = torch.randn(SMALL_OUT + 7, 48)
    assert not uses_onednn(torch.randn(FEW_ROWS, 48), w)  # a decode step's few rows
    assert not uses_onednn(torch.randn(1, FEW_ROWS, 48), w)
    assert not uses_onednn(torch.randn(0, 48), w)
    assert not uses_onednn(torch.randn(64, 48, dtype=torch.float64), w.double())  # float64: exact paths
    assert not uses_onednn(torch.randn(64, 48), w.double())
    x = torch.randn(64, 48, dtype=torch.float64)
    assert torch.equal(matmul_nt(x, w.double()), torch.matmul(x, w.double().t()))


def kernels_flag_in_a_fresh_process(flag: str, env: dict) -> str:
    code = f"from pdserve.model import kernels; print(kernels.{flag})"
    env = {**env, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_onednn_is_opt_in():
    for env, want in (({}, False), ({"PDSERVE_ONEDNN": "0"}, False), ({"PDSERVE_ONEDNN": "1"}, True)):
        assert kernels_flag_in_a_fresh_process("ONEDNN", env) == str(want and kernels.ONEDNN_AVAILABLE)
    if os.environ.get("PDSERVE_ONEDNN") != "1":  # off (the default), a float32 prefill product is torch's own
        x, w = torch.randn(64, 48), torch.randn(SMALL_OUT + 7, 48)
        assert not kernels.ONEDNN and not uses_onednn(x, w)
        assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.fixture
def gemv_on(monkeypatch):
    """PDSERVE_ONEDNN_GEMV unset or 1, as an instance runs by default."""
    if not kernels.ONEDNN_AVAILABLE:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(kernels, "ONEDNN_GEMV", True)


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_times_a_large_float32_w_takes_onednn_and_matches(gemv_on, monkeypatch, bias):
    calls = []
    monkeypatch.setattr(layers, "onednn_linear", lambda *a: calls.append(1) or kernels.onednn_linear(*a))
    g = torch.Generator().manual_seed(7)
    k = 512
    n = kernels.GEMV_MIN_BYTES // (4 * k)  # W of exactly the threshold
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(1, 2 * k, generator=g)[:, ::2]  # a non-contiguous row
    assert kernels.uses_onednn_gemv(x, w)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(linear(x, w, b), ref, rtol=1e-5, atol=1e-4)
    assert calls == [1]


def test_what_stays_off_the_onednn_gemv(gemv_on, monkeypatch):
    k = 512
    n = kernels.GEMV_MIN_BYTES // (4 * k)
    w = torch.randn(n, k)
    assert not kernels.uses_onednn_gemv(torch.randn(1, k), w[:-1])  # below the threshold
    assert not kernels.uses_onednn_gemv(torch.randn(2, k), w)  # more than one row
    assert not kernels.uses_onednn_gemv(torch.randn(1, 1, k), w)  # not [1, in]
    assert not kernels.uses_onednn_gemv(torch.randn(1, k, dtype=torch.float64), w.double())  # exact paths

    def no_onednn(*args):
        raise AssertionError("went to oneDNN")

    monkeypatch.setattr(layers, "onednn_linear", no_onednn)
    x = torch.randn(1, k, dtype=torch.float64)
    torch.testing.assert_close(linear(x, w.double()), F.linear(x, w.double()), rtol=1e-13, atol=1e-12)
    linear(torch.randn(1, k), w[:-1])  # a float32 W below the threshold


def test_onednn_gemv_is_on_by_default_and_can_be_turned_off():
    for env, want in (
        ({}, True),
        ({"PDSERVE_ONEDNN_GEMV": "1"}, True),
        ({"PDSERVE_ONEDNN_GEMV": "0"}, False),
    ):
        got = kernels_flag_in_a_fresh_process("ONEDNN_GEMV", env)
        assert got == str(want and kernels.ONEDNN_AVAILABLE)
