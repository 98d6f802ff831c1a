"""The README's benchmark table is generated from bench/results/*.json and must agree with them."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    """A stdlib-only bench script as a module of its own name (bench_NAME), outside sys.path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_table():
    return load_bench("table")


def test_readme_table_matches_the_result_files():
    table = load_table()
    text = table.README.read_text()
    assert table.update(text) == text, "run: python bench/table.py"
    assert table.main(["--check"]) == 0


def test_summary_rows_are_rendered_and_a_changed_number_is_caught(tmp_path):
    table = load_table()
    row = {
        "claim": "stack c=32 output tok/s over transformers' best batch",
        "result": "5.3x",
        "baseline": "transformers batch 8 | same prompts",
        "bound": None,
        "target": ">= 5x",
        "met": True,
    }
    doc = {"machine": {"date": "2026-11-30T10:00:00", "commit": "abc1234"}, "summary": [row]}
    (tmp_path / "serve.json").write_text(json.dumps(doc))
    rendered = table.render(tmp_path)
    line = next(x for x in rendered.splitlines() if "bench/serve.py" in x)
    assert "5.3x" in line and ">= 5x (met)" in line and "2026-11-30 abc1234" in line
    assert "batch 8 \\| same" in line  # a | inside a cell is escaped, not a new column
    assert "bench/engine.py` | - | not run" in rendered  # a missing result file says so
    readme = f"# x\n\n{rendered}\n\ntail\n"
    row["result"] = "4.1x"
    (tmp_path / "serve.json").write_text(json.dumps(doc))
    assert table.replace(readme, table.render(tmp_path)) != readme  # a stale table is detected


def test_every_bench_make_bench_runs_has_its_rows_in_the_table():
    run_all = load_bench("run_all")
    assert [script.removesuffix(".py") for script, _ in run_all.BENCHES] == list(load_table().ORDER)


def test_the_hardware_table_says_what_each_record_says(tmp_path):
    """The README's "Run on hardware" rows come from the records: a GPU device check's counts and
    the test files that passed on the GPU, a missing record is "never", and a changed record is a
    stale table."""
    table = load_table()
    check = {
        "date": "2026-12-01T10:00:00+00:00",
        "environment": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"},
        "passed": 2,
        "failed": 1,
        "skipped": 0,
        "all_passed": False,
        "checks": [
            {"name": "tests.gpu.test_nccl::test_a", "outcome": "passed"},
            {"name": "tests.gpu.test_cuda_graphs::test_b", "outcome": "failed"},
        ],
    }
    (tmp_path / "device_check.json").write_text(json.dumps(check))
    rendered = table.render_facts(tmp_path)
    line = next(x for x in rendered.splitlines() if x.startswith("| GPU device check (`tests/gpu`)"))
    assert "NVIDIA H200" in line and "2026-12-01" in line and "2 passed, 1 failed" in line
    assert "passed in: test_nccl" in line and "test_cuda_graphs" not in line and "all passed" not in line
    assert "| GPU device check with flashinfer (`tests/gpu`) | - | never |" in rendered
    readme = f"# x\n\n{table.render(tmp_path)}\n\n{rendered}\n"
    assert table.update(readme, tmp_path) == readme
    check["passed"] = 3
    (tmp_path / "device_check.json").write_text(json.dumps(check))
    assert table.update(readme, tmp_path) != readme
