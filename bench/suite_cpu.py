"""Where the test suite's CPU goes: a pytest plugin that records, per test, the machine's busy CPU
seconds (/proc/stat: every process, so a test's servers and rank processes count) and its wall
time, and a summary of such a record by file. Run the suite on ONE worker (no -n), on an idle
machine, so each test's CPU is its own:

    PYTHONPATH=bench .venv/bin/python -m pytest -q -p suite_cpu tests     # writes $SUITE_CPU_OUT
    .venv/bin/python bench/suite_cpu.py /tmp/suite_cpu.jsonl --top 25      # totals, files, tests

Not a claim of the README table: what issue 42's test-time work measures (make test runs two
xdist workers on 2 cores, so its wall time follows the suite's CPU)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import pytest
from common import system_busy_seconds

OUT = os.environ.get("SUITE_CPU_OUT", "/tmp/suite_cpu.jsonl")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = system_busy_seconds(), time.monotonic()
    yield
    row = {
        "id": item.nodeid,
        "cpu": round(system_busy_seconds() - cpu, 2),
        "wall": round(time.monotonic() - wall, 2),
    }
    with open(OUT, "a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", help="a JSON-lines file the plugin wrote")
    ap.add_argument("--top", type=int, default=20, help="files and tests to list (default 20)")
    a = ap.parse_args(argv)
    with open(a.record) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    cpu, wall = sum(r["cpu"] for r in rows), sum(r["wall"] for r in rows)
    print(
        f"{len(rows)} tests: {cpu:.1f} CPU s in {wall:.1f} s of wall ({cpu / max(wall, 1e-9):.2f} cores busy)"
    )
    files = collections.Counter()
    for r in rows:
        files[r["id"].split("::")[0]] += r["cpu"]
    print(f"\nCPU s by file (top {a.top}):")
    for name, s in files.most_common(a.top):
        print(f"{s:8.1f}  {name}")
    print(f"\nCPU s, wall s by test (top {a.top}):")
    for r in sorted(rows, key=lambda r: -r["cpu"])[: a.top]:
        print(f"{r['cpu']:8.1f} {r['wall']:7.1f}  {r['id']}")


if __name__ == "__main__":
    main()
