"""native/ops.py and native/rows.c: the few-row float32 CPU kernels agree with float64 references
for every row count up to MAX_ROWS and sizes that are not multiples of the vector width, on strided
rows; their results do not depend on the thread count (each output is one thread's sum); `linear`
and MLA's absorption route a decode step's products to them and nothing else; a machine where the
kernel cannot be built (PDSERVE_NATIVE=0, no compiler) keeps torch's kernels with the reason in
`status()`; ranks building at once each get a working library."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.kernels import absorb_o, absorb_q
from pdserve.model.layers import linear
from pdserve.native import ops as native

pytestmark = pytest.mark.skipif(
    native.status().startswith("unavailable"), reason=f"the native kernel is {native.status()}"
)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 sums against a float64 reference: relative to the largest output."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    assert (y.double() - ref).abs().max().item() <= 2e-5 * scale


@pytest.mark.parametrize("rows", range(1, native.MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (17, 40), (33, 517), (300, 64), (130, 2048)])
def test_rows_linear_matches_float64(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k + 3, generator=g)[:, 1 : k + 1]  # rows apart by more than k
    x = torch.randn(rows, k + 5, generator=g)[:, 2 : k + 2]
    b = torch.randn(n, generator=g)
    for bias in (None, b):
        assert native.usable(x, w, bias)
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        _close(native.rows_linear(x, w, bias), ref)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("heads,nope,v,c", [(16, 128, 128, 512), (3, 5, 7, 300), (1, 16, 16, 1030)])
def test_absorption_kernels_match_float64(rows, heads, nope, v, c):
    g = torch.Generator().manual_seed(rows + heads + c)
    kv_b = torch.randn(heads * (nope + v), c, generator=g).view(heads, nope + v, c)  # as kv_b_proj's weight
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    q = torch.randn(rows, heads, nope + 9, generator=g)[:, :, :nope]  # q_nope: a view of q
    o = torch.randn(rows, heads, c, generator=g)
    assert native.heads_usable(q, w_uk, 1) and native.heads_usable(o, w_uv, 2)
    _close(absorb_q(q, w_uk), torch.einsum("thn,hnc->thc", q.double(), w_uk.double()))
    _close(absorb_o(o, w_uv), torch.einsum("thc,hvc->thv", o.double(), w_uv.double()))


def test_results_do_not_depend_on_the_thread_count(assert_thread_count_free):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(1000, 777, generator=g), torch.randn(3, 777, generator=g)
    kv_b = torch.randn(8, 64, 512, generator=g)
    q, o = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 512, generator=g)
    assert_thread_count_free(
        lambda: (native.rows_linear(x, w), absorb_q(q, kv_b[:, :32]), absorb_o(o, kv_b[:, 32:]))
    )


def test_linear_and_absorption_route_only_a_decode_steps_products(native_calls):
    calls = native_calls
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 40, generator=g)
    linear(torch.randn(native.MAX_ROWS, 40, generator=g), w)
    assert calls == ["pd_heads_linear"]
    calls.clear()
    linear(torch.randn(native.MAX_ROWS + 1, 40, generator=g), w)  # prefill: torch's (or oneDNN's)
    linear(torch.randn(2, 40, dtype=torch.float64, generator=g), w.double())  # float64: exact paths
    linear(torch.randn(2, 80, generator=g)[:, ::2], w)  # a row that is not contiguous
    linear(torch.randn(2, 40, generator=g), w.t().contiguous().t())  # W's rows not contiguous
    kv_b = torch.randn(4, 16, 64, dtype=torch.float64, generator=g)
    absorb_q(torch.randn(1, 4, 8, dtype=torch.float64, generator=g), kv_b[:, :8])
    absorb_o(torch.randn(native.MAX_ROWS + 1, 4, 64, generator=g), kv_b[:, 8:].float())
    assert calls == []


def _status_in_a_fresh_process(env: dict, cache) -> str:
    code = "from pdserve.native import ops as native; print(native.status())"
    env = {**os.environ, "PDSERVE_CACHE": str(cache), **env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_machine_without_the_kernel_keeps_torchs_kernels(tmp_path):
    assert _status_in_a_fresh_process({"PDSERVE_NATIVE": "0"}, tmp_path) == "off (PDSERVE_NATIVE=0)"
    no_cc = _status_in_a_fresh_process({"CC": "/bin/false"}, tmp_path)
    assert no_cc.startswith("unavailable: /bin/false failed"), no_cc
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind


def test_a_cache_another_user_could_write_is_not_loaded(tmp_path):
    """A world-writable cache directory (anyone could plant a library there) keeps torch's kernels."""
    cache = tmp_path / "native"
    cache.mkdir()
    cache.chmod(0o777)
    status = _status_in_a_fresh_process({}, tmp_path)
    assert status.startswith("unavailable:") and "writable by group or others (mode 777)" in status, status
    assert not list(cache.glob("*.so"))  # nothing built into it either


def test_ranks_building_at_once_each_get_the_library(tmp_path):
    code = "from pdserve.native import ops as native; import torch; print(native.status()); " + (
        "print(float(native.rows_linear(torch.ones(1, 9), torch.ones(5, 9)).sum()))"
    )
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].split("\n") for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(o[0].startswith("native few-row kernels") and o[1] == "45.0" for o in outs), outs
    assert len(list((tmp_path / "native").glob("*.so"))) == 1
