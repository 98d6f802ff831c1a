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
    assert table.replace(text, table.render()) == text, "run: python bench/table.py"
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
