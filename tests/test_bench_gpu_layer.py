"""bench/gpu_layer.py: its smoke run (tiny dims on the CPU) gives every row the fields the README's
GPU table and the issue's targets read, with bounds that are fractions of measured time; the table
in README.md is the one bench/gpu_layer_report.py makes from bench/results/gpu_layer.json."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

FIELDS = ("phase", "shape", "batch", "context", "weight_dtype", "graphs", "ms", "bound_ms", "of_bound")


BENCH = str(Path(__file__).resolve().parents[1] / "bench")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run for the module (bench_module is per test): about 8 s on 2 cores."""
    out = tmp_path_factory.mktemp("gpu_layer") / "gpu_layer.json"
    sys.path.insert(0, BENCH)
    try:
        assert importlib.import_module("gpu_layer").main(["--smoke", "--out", str(out)]) == 0
    finally:
        sys.path.remove(BENCH)
    return json.loads(out.read_text())


def test_smoke_rows_cover_every_shape_dtype_and_phase(smoke):
    assert smoke["errors"] == [] and smoke["skipped"] == []
    rows = smoke["rows"]
    seen = {(r["phase"], r["shape"], r["weight_dtype"]) for r in rows}
    for shape in ("tp1", "tp8", "ep8"):
        for wd in ("bf16", "fp8"):
            assert {("moe_decode", shape, wd), ("layer_decode", shape, wd)} <= seen
    assert {("prefill", "tp1", "bf16"), ("prefill", "tp1", "fp8")} <= seen
    assert any(r["moe_ops"] == "torch" and r["phase"] == "moe_decode" for r in rows)  # today's baseline
    for r in rows:
        assert all(k in r for k in FIELDS), r
        assert r["ms"] > 0 and r["bound_ms"] > 0
        assert r["of_bound"] == pytest.approx(r["bound_ms"] / r["ms"], rel=1e-2, abs=1e-3)
        assert r["bound_ms"] == pytest.approx(max(r["hbm_bound_ms"], r["flop_bound_ms"]), rel=1e-3, abs=1e-4)


def test_fp8_rows_read_fewer_bytes_than_bf16(smoke):
    """The bound follows the weights actually held: fp8 experts are half of bf16's bytes (float32 on
    the CPU run: a quarter), scales included."""
    by = {
        (r["phase"], r["shape"], r["weight_dtype"], r["batch"]): r
        for r in smoke["rows"]
        if r["moe_ops"] != "torch"
    }
    for (phase, shape, wd, batch), r in by.items():
        if phase == "moe_decode" and wd == "fp8":
            assert r["bytes"] < by[(phase, shape, "bf16", batch)]["bytes"]


def test_readme_gpu_table_matches_results(bench_module):
    assert bench_module("gpu_layer_report").main(["--check"]) == 0


def test_report_renders_rows(bench_module, smoke, tmp_path):
    report = bench_module("gpu_layer_report")
    smoke["summary"] = [
        {"measure": "tp1: x", "ms": 2.0, "bound_ms": 1.0, "of_bound": 0.5, "target": 0.5, "met": True}
    ]
    text = report.table(smoke)
    assert "| tp1: x | 2 | 1 | 0.5 | >= 0.5 | yes |" in text
    assert text.count("\n| moe_decode |") == sum(r["phase"] == "moe_decode" for r in smoke["rows"])
