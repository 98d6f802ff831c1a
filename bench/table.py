"""The README's benchmark table, generated from bench/results/*.json (stdlib only, no torch).

Each bench writes a `summary` list into its JSON: one row per claim, with the result (a ratio of
medians), the fair baseline it was measured against, the bound it is a fraction of, the target and
whether it was met. This script renders those rows between the README's two markers:

    python bench/table.py          rewrite the table in README.md
    python bench/table.py --check  exit 1 if README.md's table differs from the JSON files

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


def render(results: Path = RESULTS) -> str:
    return "\n".join([START, HEADER, *rows(results), END])


def replace(text: str, table: str) -> str:
    a, b = text.index(START), text.index(END) + len(END)
    return text[:a] + table + text[b:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
    a = p.parse_args(argv)
    text = README.read_text()
    new = replace(text, render())
    if a.check:
        if new != text:
            print("README.md's benchmark table differs from bench/results: run python bench/table.py")
            return 1
        return 0
    README.write_text(new)
    print(f"wrote the benchmark table of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
