"""The README's benchmark table, generated from bench/results/*.json (stdlib only, no torch).

Each bench writes a `summary` list into its JSON: one row per claim, with the result (a ratio of
medians), the fair baseline it was measured against, the bound it is a fraction of, the target and
whether it was met. This script renders those rows between the README's two markers:

    python bench/table.py          rewrite the tables in README.md
    python bench/table.py --check  exit 1 if README.md's tables differ from the JSON files

A second table, between its own markers, says what ran on real hardware and when: the GPU device
checks (tests/gpu, bench/results/device_check*.json), the GPU layer bench and the CPU image built
and served with docker compose (tests/system/test_image_compose.py). The README's status table
points at it instead of restating it, so the status and the records cannot disagree.

tests/test_bench_table.py runs the check, so the table and the JSON files cannot drift apart.
A result file without a `summary` (written before the benches reported fair baselines) gets a row
that says so instead of a number."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
ORDER = (
    "engine",
    "prefill_cp",
    "decode_dcp",
    "transfer",
    "handoff_overlap",
    "transfer_floor",
    "serve",
    "prefix_cache",
)
FACTS_START, FACTS_END = "<!-- hardware-table:start -->", "<!-- hardware-table:end -->"
FACTS_HEADER = "| what ran | where | when | result | record |\n|---|---|---|---|---|"
HEADER = (
    "| bench | claim | result | fair baseline | bound (fraction of it) | target | run |\n"
    "|---|---|---|---|---|---|---|"
)


def cell(v) -> str:
    return "-" if v in (None, "") else str(v).replace("|", "\\|").replace("\n", " ")


def rows(results: Path = RESULTS) -> list[str]:
    out = []
    for name in ORDER:
        path = results / f"{name}.json"
        if not path.exists():
            out.append(f"| `bench/{name}.py` | - | not run | - | - | - | - |")
            continue
        doc = json.loads(path.read_text())
        m = doc.get("machine", {})
        run = " ".join(x for x in (str(m.get("date", ""))[:10], m.get("commit") or "") if x)
        summary = doc.get("summary")
        if not summary:
            out.append(
                f"| `bench/{name}.py` | - | result predates fair baselines: rerun `make bench` | - | - | - | "
                f"{cell(run)} |"
            )
            continue
        for r in summary:
            met = {True: " (met)", False: " (missed)"}.get(r.get("met"), "")
            out.append(
                "| "
                + " | ".join(
                    [
                        f"`bench/{name}.py`",
                        cell(r.get("claim")),
                        cell(r.get("result")),
                        cell(r.get("baseline")),
                        cell(r.get("bound")),
                        cell(r.get("target")) + met,
                        cell(run),
                    ]
                )
                + " |"
            )
    return out


def _device_check(doc: dict, what: str, record: str) -> str:
    env = doc.get("environment", {})
    where = f"{env.get('gpu', '?')}, torch {env.get('torch', '?')}"
    count = f"{doc.get('passed', 0)} passed, {doc.get('failed', 0)} failed, {doc.get('skipped', 0)} skipped"
    ran = sorted(
        {
            c["name"].split("::")[0].removeprefix("tests.gpu.")
            for c in doc.get("checks", [])
            if c.get("outcome") == "passed"
        }
    )
    result = (
        f"{count}{' (all passed)' if doc.get('all_passed') else ''}; passed in: {', '.join(ran) or 'none'}"
    )
    return f"| {what} | {cell(where)} | {str(doc.get('date', ''))[:10]} | {cell(result)} | `{record}` |"


def fact_rows(results: Path = RESULTS) -> list[str]:
    out = []
    for name, what in (
        ("device_check", "GPU device check (`tests/gpu`)"),
        ("device_check_flashinfer", "GPU device check with flashinfer (`tests/gpu`)"),
    ):
        path = results / f"{name}.json"
        out.append(
            _device_check(json.loads(path.read_text()), what, f"bench/results/{name}.json")
            if path.exists()
            else f"| {what} | - | never | - | - |"
        )
    path = results / "gpu_layer.json"
    if path.exists():
        doc = json.loads(path.read_text())
        result = f"{len(doc.get('rows', []))} rows, {len(doc.get('errors') or [])} errors"
        out.append(
            f"| one decode layer on the GPU (`bench/gpu_layer.py`) | {cell(doc.get('device'))}, torch "
            f"{cell(doc.get('torch'))} | {str(doc.get('date', ''))[:10]} | {result} | `bench/results/gpu_layer.json` |"
        )
    path = results / "image_cpu.json"
    if path.exists():
        doc = json.loads(path.read_text())
        result = (
            f"CPU image built offline in {doc.get('build_s', '?')} s ({doc.get('image_bytes', 0) / 1e9:.2f} GB); "
            "the same `make test-system` serves the quickstart through it with docker compose"
        )
        out.append(
            "| docker image + compose (`tests/system/test_image_compose.py`, `make test-system`) | docker.io, "
            f"debootstrap base | {str(doc.get('date') or '')[:10] or 'before records were dated'} | {result} | `bench/results/image_cpu.json` |"
        )
    return out


def render(results: Path = RESULTS) -> str:
    return "\n".join([START, HEADER, *rows(results), END])


def render_facts(results: Path = RESULTS) -> str:
    return "\n".join([FACTS_START, FACTS_HEADER, *fact_rows(results), FACTS_END])


def replace(text: str, table: str, start: str = START, end: str = END) -> str:
    a, b = text.index(start), text.index(end) + len(end)
    return text[:a] + table + text[b:]


def update(text: str, results: Path = RESULTS) -> str:
    """README text with both generated tables rendered from `results`."""
    text = replace(text, render(results))
    return replace(text, render_facts(results), FACTS_START, FACTS_END)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
    a = p.parse_args(argv)
    text = README.read_text()
    new = update(text)
    if a.check:
        if new != text:
            print("README.md's generated tables differ from bench/results: run python bench/table.py")
            return 1
        return 0
    README.write_text(new)
    print(f"wrote the benchmark and hardware tables of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
