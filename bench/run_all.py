"""`make bench`: every bench in sequence, then the README's table regenerated from their JSON files.

    python bench/run_all.py            the full runs (an hour or more on 2 cores)
    python bench/run_all.py --quick    a smoke run of each (under 15 minutes): small sizes, few
                                       repeats, results in --out (default: a temporary folder, so a
                                       smoke run never overwrites the committed results)

A bench that fails is reported and the rest still run; the exit status is 1 if any failed."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (script, extra arguments of a quick run)
BENCHES = (
    (
        "engine.py",
        ["--lengths", "512,1024", "--decode-batches", "1,4", "--decode-steps", "8", "--repeats", "1"],
    ),
    ("prefill_cp.py", ["--lengths", "1024,2048", "--repeats", "1", "--idle-wait", "5"]),
    ("decode_dcp.py", ["--contexts", "2048", "--batches", "1", "--steps", "4", "--rounds", "1"]),
    (
        "transfer.py",
        ["--sizes", "1,64", "--tokens", "2048", "--repeats", "2", "--handoff-repeats", "2"]
        + ["--overlap-tokens", "2048"],
    ),
    ("handoff_overlap.py", ["--tokens", "2048", "--repeats", "1", "--idle-wait", "5"]),
    ("transfer_floor.py", ["--chunks-mb", "0,8", "--repeats", "3", "--idle-wait", "5"]),
    ("serve.py", ["--quick", "--idle-wait", "5"]),
    ("prefix_cache.py", ["--quick", "--idle-wait", "5"]),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every bench")
    p.add_argument("--only", default="", help="comma-separated bench names to run (default: all)")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default bench/results; quick: a temp dir)"
    )
    a = p.parse_args(argv)
    out = a.out or (Path(tempfile.mkdtemp(prefix="pdserve-bench-quick-")) if a.quick else HERE / "results")
    only = {x.removesuffix(".py") for x in a.only.split(",") if x}
    failed = []
    for script, quick_args in BENCHES:
        if only and script.removesuffix(".py") not in only:
            continue
        cmd = [sys.executable, str(HERE / script), "--out", str(out), *(quick_args if a.quick else [])]
        print(f"== {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        print(f"== {script}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(script)
    if out == HERE / "results":
        subprocess.run([sys.executable, str(HERE / "table.py")], check=False)
    print(f"results in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
