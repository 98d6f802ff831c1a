"""What the bench scripts share: free ports, CPU accounting from /proc, waiting for an idle machine,
the CPU's name, and the --model / --out arguments. bench/ is on sys.path when a script runs."""

from __future__ import annotations

import argparse
import os
import platform
import socket
import time
from pathlib import Path

IDLE_CORES = 0.25  # "idle": other processes use less than this many cores
RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) so far, in seconds (clock-tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "(comm)": [11], [12]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (every core; /proc/stat "cpu" line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait; guest is in user


def wait_until_idle(max_s: float, threshold: float = IDLE_CORES) -> dict:
    """Waits (up to max_s) until other processes use < threshold cores for two 1-s samples in a row.

    The machine is shared: another developer's test run on one of the 2 cores halves C_p=2's speed.
    Our ranks are blocked between measurements, so what is busy now is someone else."""
    t0, quiet, last = time.perf_counter(), 0, None
    while True:
        b0 = system_busy_seconds()
        time.sleep(1.0)
        last = system_busy_seconds() - b0
        quiet = quiet + 1 if last < threshold else 0
        waited = time.perf_counter() - t0
        if quiet >= 2 or waited >= max_s:
            return {"waited_seconds": waited, "busy_cores_before": last, "idle": quiet >= 2}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def add_model_and_out(p: argparse.ArgumentParser, name: str) -> None:
    """--model (default: the built-in small model) and --out (where NAME.json and NAME.png go)."""
    p.add_argument(
        "--model",
        type=str,
        default=None,
        help="checkpoint directory (default: the built-in small glm_moe_dsa model)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help=f"output folder for {name}.json and {name}.png (default bench/results)",
    )


def resolve_model(model: str | None) -> str:
    """--model, or the built-in small model (built once under ~/.cache/pdserve)."""
    from pdserve.cli import ensure_builtin_model

    return str(Path(model) if model else ensure_builtin_model())
