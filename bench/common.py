"""What the bench scripts share: free ports, CPU accounting from /proc, waiting for an idle machine,
the CPU's name, and the --model / --out arguments. bench/ is on sys.path when a script runs."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from pdserve.serving.ports import free_port  # noqa: F401 (the benches import it from here)

IDLE_CORES = 0.25  # "idle": other processes use less than this many cores
RESULTS = Path(__file__).parent / "results"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) so far, in seconds (clock-tick resolution)."""
    return sum(cpu_user_system(pid))


def cpu_user_system(pid: int) -> tuple[float, float]:
    """(utime, stime) of a process (all its threads) so far, in seconds: system time is the kernel's
    work on its behalf (a shared-memory WRITE's copy runs there)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "(comm)": [11], [12]
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


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
    from pdserve.cli.main import ensure_builtin_model

    return str(Path(model) if model else ensure_builtin_model())


def preset_model(size: str, arch: str = "glm_moe_dsa") -> str:
    """A `pdserve make-model` preset, built once beside the built-in model (seed 0)."""
    from pdserve.checkpoints.random_checkpoint import make_model
    from pdserve.cli.common import builtin_model_dir

    path = builtin_model_dir().parent / f"{size}-{arch}-seed0"
    if not (path / "config.json").is_file():
        print(f"building the {size} {arch} model in {path} (once)", file=sys.stderr, flush=True)
        make_model(path, arch, size, seed=0, overwrite=True)
    return str(path)


def machine_info(packages: tuple[str, ...] = ("torch", "transformers")) -> dict:
    """What every result JSON records: cores, CPU, platform, versions, the commit and the date."""
    import datetime
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(
                ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = None if status is None else bool(status)
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{name: ver(name) for name in packages},
        "commit": commit,
        "uncommitted_changes": dirty,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "loadavg_at_start": os.getloadavg(),
    }


def spread(values: list[float]) -> dict:
    """min / median / max of repeated measurements (the headline ratios are ratios of medians)."""
    import statistics

    xs = [v for v in values if v is not None]
    if not xs:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def idle_side(max_s: float, label: str) -> dict:
    """Waits for an idle machine before one side of a comparison and says what it found."""
    import sys

    w = wait_until_idle(max_s)
    w["loadavg_before"] = os.getloadavg()
    note = (
        "idle"
        if w["idle"]
        else f"NOT idle after {w['waited_seconds']:.0f} s ({w['busy_cores_before']:.2f} cores busy)"
    )
    print(f"  [{label}] machine {note}", file=sys.stderr, flush=True)
    return w
