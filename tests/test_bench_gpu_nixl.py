"""bench/gpu_nixl.py, the VRAM WRITE sweep of issue 41, smoke-tested on host memory: every setting
asked gives one row per size with a rate, every WRITE is notified, the JSON is complete, and bad
arguments are refused before anything starts."""

import json
import time

import pytest


@pytest.fixture
def gpu_nixl(bench_module):
    """Imported as the script imports itself: the spawned processes unpickle their functions from
    `gpu_nixl` on the path they inherit."""
    return bench_module("gpu_nixl")


def test_a_cpu_run_measures_every_size_and_setting(gpu_nixl, tmp_path):
    out = tmp_path / "gpu_nixl.json"
    gpu_nixl.main(
        ["--device", "cpu", "--sizes-mb", "1,4", "--settings", "default,no_cuda_ipc", "--repeats", "2"]
        + ["--out", str(out)]
    )
    doc = json.loads(out.read_text())
    assert [(r["setting"], r["bytes"]) for r in doc["rows"]] == [
        (s, n << 20) for s in ("default", "no_cuda_ipc") for n in (1, 4)
    ]
    for row in doc["rows"]:
        assert "error" not in row, row
        assert row["write_gb_per_s"] > 0 and row["write_over_copy"] > 0 and row["write_ms_median"] > 0
    assert doc["notifications"] == {"default": 6, "no_cuda_ipc": 6}  # 2 sizes x (1 untimed + 2)
    assert set(doc["copy_gb_per_s"]) == {str(1 << 20), str(4 << 20)}
    assert doc["best"] in doc["rows"] and doc["device"] == "cpu"
    # UCX says how it writes host memory here: its put protocol table, size range by transport
    tables = doc["ucx_protocols"]["default"]
    assert any("remote memory write by ucp_put" in line for line in tables)
    assert any(line.startswith("  0..") for line in tables), tables
    assert "ucx_log_tail" not in doc


def test_a_setting_whose_process_dies_is_recorded_and_the_next_runs(gpu_nixl, tmp_path, monkeypatch):
    """A sender or receiver that cannot start (UCX given no usable transport) makes an error row and
    its log's tail, within seconds; the setting after it still measures."""
    monkeypatch.setitem(gpu_nixl.SETTINGS, "broken", {"UCX_TLS": "no_such_transport"})
    out = tmp_path / "gpu_nixl.json"
    t0 = time.monotonic()
    gpu_nixl.main(
        ["--device", "cpu", "--sizes-mb", "1", "--settings", "broken,default", "--repeats", "1"]
        + ["--out", str(out)]
    )
    assert time.monotonic() - t0 < 60
    doc = json.loads(out.read_text())
    broken, default = doc["rows"]
    assert broken["setting"] == "broken" and "exited with code" in broken["error"]
    assert any("NIXL_ERR_BACKEND" in line for line in doc["ucx_log_tail"]["broken"])
    assert default["write_gb_per_s"] > 0 and doc["best"] == default


@pytest.mark.parametrize(
    "args",
    [
        ["--settings", "nvlink"],
        ["--sizes-mb", "0"],
        ["--sizes-mb", "x"],
        ["--repeats", "0"],
        ["--device", "tpu"],
    ],
)
def test_bad_arguments_are_refused(gpu_nixl, tmp_path, args, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_nixl.main(["--device", "cpu", "--out", str(tmp_path / "x.json"), *args])
    assert e.value.code == 2 and "error" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
