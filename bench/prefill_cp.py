"""Prefill context-parallelism benchmark: time to first token at C_p = 1 vs C_p = 2, and layout balance.

Claim measured: at 16k tokens a prefill instance with C_p = 2 ranks (one torch thread per rank) is
at least 1.7x faster to the first token than C_p = 1 (one thread), on the built-in `small` model
(glm_moe_dsa, DSA index_topk 256, float32 on CPU, interleave layout, full cache, chunks of 4096).
On a 2-core machine the ceiling is 2x.
  1. TTFT: one PrefillInstance per C_p (the prefill instance API directly, no HTTP), all started
     together (each rank is a process that loads the model) and warmed up (a 300-token prompt, then
     one full chunk). Then for every prompt length (2048, 4096, 8192, 16384) and repeat, one prefill
     per instance, alternating the order of the instances between repeats so that drift on a shared
     machine hits every C_p alike; the best of --repeats counts. TTFT is the wall time of
     `instance.prefill()` (all ranks' forward + sampling of the first token, greedy). The first
     token must be the same for every C_p; it is recorded. Each rank's CPU time over the timed
     prefill is recorded too (from /proc/<pid>/stat): rank CPU / wall well below 1 means the rank
     waits (collectives, the busiest rank) instead of computing. The machine is shared, so before
     each timed prefill the script waits (up to --idle-wait s) until other processes use under
     0.25 cores, and records the cores they used during the run (/proc/stat minus our processes);
     a run where they took more than 0.15 of the cores its C_p ranks needed is marked "*".
  2. Layout balance, pure accounting (no model): for C = 2, 4, 8 ranks and prompts of 16 and
     131072 tokens, the busiest rank's causal query-key pairs over the average per rank, for the
     interleave, zigzag and contiguous layouts (pdserve.prefill_server.layouts.balance).
A rank failure (RankError, with the rank's traceback) is recorded as {"error": ...}, printed, and
that instance's remaining lengths are skipped; the other instances go on.

Run:  .venv/bin/python bench/prefill_cp.py      (writes bench/results/prefill_cp.json and prefill_cp.png)
      About 5 minutes on 2 idle cores with the defaults (the C_p = 1 prefill of 16384 tokens takes
      about 35 s and runs twice); longer on a busy machine, since it waits for other processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
import traceback
from importlib.metadata import version
from pathlib import Path

WARMUP_TOKENS = 300
PAGE_SIZE = 16
LAYOUTS = ("interleave", "zigzag", "contiguous")
CLAIM_RATIO = 1.7
IDLE_CORES = 0.25  # "idle": other processes use less than this many cores
NOISY_CORES = 0.15  # a run is "contended" (flagged "*") when other processes took more than this of the cores its ranks needed


# ---------------------------------------------------------------- helpers
def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """The same random prompts as bench/engine.py (seed = length), so every C_p sees the same tokens."""
    import torch

    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)": fields[11], [12] are utime, stime
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (every core; /proc/stat "cpu" line)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait; guest is in user


def wait_until_idle(max_s: float, threshold: float = IDLE_CORES) -> dict:
    """Waits (up to max_s) until other processes use < threshold cores for two 1-s samples in a row.

    The machine is shared: another developer's test run on one of the 2 cores halves C_p=2's speed.
    Our ranks are blocked between prefills, so what is busy now is someone else."""
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


# ---------------------------------------------------------------- balance (pure accounting)
def balance_table(cp_sizes: list[int], lengths: list[int]) -> dict:
    from pdserve.prefill_server.layouts import balance, pair_counts

    return {
        layout: {
            str(n): {
                str(c): {"busiest_over_average": balance(layout, n, c), "pairs": pair_counts(layout, n, c)}
                for c in cp_sizes
            }
            for n in lengths
        }
        for layout in LAYOUTS
    }


# ---------------------------------------------------------------- TTFT measurement
class Bench:
    """One started PrefillInstance per C_p, measured in alternation."""

    def __init__(self, a: argparse.Namespace, model_dir: str):
        from pdserve.prefill_server.rank_worker import PrefillWorkerConfig

        self.a = a
        longest = max(a.lengths + [WARMUP_TOKENS, a.chunk_size])
        num_slots = -(-longest // PAGE_SIZE) * PAGE_SIZE  # one request held at a time; whole pages
        self.worker = PrefillWorkerConfig(
            model_dir,
            num_slots=num_slots,
            dtype="float32",
            layout=a.layout,
            cache=a.cache,
            moe_tp=False,
            query_block=a.query_block,
        )
        self.instances: dict[int, object] = {}
        self.errors: dict[int, str] = {}
        self.startup: dict[str, dict] = {}

    def start(self) -> None:
        from pdserve.engine.launcher import LaunchConfig
        from pdserve.prefill_server.instance import PrefillInstance

        for cp in self.a.cp_sizes:
            launch = LaunchConfig(
                cp,
                free_port(),
                threads_per_rank=1,
                ready_timeout_s=self.a.timeout,
                collective_timeout_s=self.a.timeout,
            )
            print(
                f"  starting C_p={cp} ({cp} rank process(es), each loads the model) ...",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            try:
                inst = PrefillInstance(
                    self.worker, launch, page_size=PAGE_SIZE, chunk_size=self.a.chunk_size
                ).start()
            except Exception:
                self._fail(cp, "start")
                continue
            start_s = time.perf_counter() - t0
            self.instances[cp] = inst
            vocab = inst.model_config.vocab_size
            warm = {}
            for n in (WARMUP_TOKENS, min(self.a.chunk_size, max(self.a.lengths))):  # first forward is slow
                r = self._prefill(cp, f"warmup{n}", prompt_ids(n, 1, vocab))
                if "error" in r:
                    break
                warm[str(n)] = r["seconds"]
            self.startup[str(cp)] = {"start_seconds": start_s, "warmup_seconds": warm, "info": inst.info()}

    def _fail(self, cp: int, what: str) -> dict:
        tb = traceback.format_exc()
        self.errors[cp] = f"{what}: {tb}"
        print(f"  C_p={cp} {what} failed:\n{tb}", file=sys.stderr, flush=True)
        inst = self.instances.pop(cp, None)
        if inst is not None:
            inst.shutdown()
        return {"error": tb.strip().splitlines()[-1], "traceback": tb}

    def _prefill(self, cp: int, rid: str, ids: list[int], timed: bool = False) -> dict:
        inst = self.instances[cp]
        pids = [r["pid"] for r in inst.rank_infos]
        idle = wait_until_idle(self.a.idle_wait) if timed and self.a.idle_wait > 0 else None
        if idle and idle["waited_seconds"] > 2.5:
            print(
                f"    waited {idle['waited_seconds']:.0f} s for other processes to go idle"
                + ("" if idle["idle"] else f" (gave up; {idle['busy_cores_before']:.2f} cores busy)"),
                file=sys.stderr,
                flush=True,
            )
        try:
            cpu0, own0, busy0 = (
                [cpu_seconds(p) for p in pids],
                cpu_seconds(os.getpid()),
                system_busy_seconds(),
            )
            t0 = time.perf_counter()
            res = inst.prefill(rid, ids)
            dt = time.perf_counter() - t0
            cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
            others = system_busy_seconds() - busy0 - sum(cpu) - (cpu_seconds(os.getpid()) - own0)
            inst.release(rid)
        except Exception:
            return self._fail(cp, f"prefill of {len(ids)} tokens")
        others = max(0.0, others / dt)
        return {
            "seconds": dt,
            "token": res.token,
            "rank_cpu_seconds": cpu,
            "rank_cpu_over_wall": [c / dt for c in cpu],
            "other_processes_cores": others,
            "contended": others + cp > (os.cpu_count() or 1) + NOISY_CORES,
            "idle_wait": idle,
        }

    def measure(self) -> dict:
        out: dict[str, dict] = {str(cp): {} for cp in self.a.cp_sizes}
        for cp, err in self.errors.items():
            for n in self.a.lengths:
                out[str(cp)][str(n)] = {"error": "instance failed to start", "traceback": err}
        for n in self.a.lengths:
            ids = None
            runs: dict[int, list[dict]] = {cp: [] for cp in self.instances}
            for rep in range(self.a.repeats):
                order = list(self.instances) if rep % 2 == 0 else list(reversed(self.instances))
                for cp in order:
                    if cp not in self.instances:  # failed earlier in this loop
                        continue
                    if ids is None:
                        ids = prompt_ids(n, n, self.instances[cp].model_config.vocab_size)
                    print(
                        f"  C_p={cp} prefill {n} tokens (repeat {rep + 1}/{self.a.repeats}) ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    r = self._prefill(cp, f"r{n}-{rep}", ids, timed=True)
                    if "error" in r:
                        runs.pop(cp)
                        out[str(cp)][str(n)] = r
                        continue
                    runs[cp].append(r)
                    print(
                        f"    {r['seconds']:.2f} s, token {r['token']}, rank CPU/wall "
                        + ", ".join(f"{u:.2f}" for u in r["rank_cpu_over_wall"])
                        + f", other processes {r['other_processes_cores']:.2f} cores",
                        file=sys.stderr,
                        flush=True,
                    )
            for cp, rs in runs.items():
                best = min(rs, key=lambda r: r["seconds"])
                out[str(cp)][str(n)] = dict(
                    best,
                    all_seconds=[r["seconds"] for r in rs],
                    tokens=[r["token"] for r in rs],
                    tokens_per_s=n / best["seconds"],
                )
        for cp in self.a.cp_sizes:  # lengths never reached because the instance failed
            for n in self.a.lengths:
                out[str(cp)].setdefault(
                    str(n), {"error": "skipped: the instance failed on an earlier prompt"}
                )
        return out

    def shutdown(self) -> None:
        for inst in self.instances.values():
            inst.shutdown()
        self.instances.clear()


def first_tokens(ttft: dict, lengths: list[int]) -> dict:
    """Per length: every C_p's first token (every repeat agreed) and whether all C_p agree."""
    out = {}
    for n in lengths:
        toks = {cp: r[str(n)]["tokens"] for cp, r in ttft.items() if "tokens" in r[str(n)]}
        flat = {t for ts in toks.values() for t in ts}
        out[str(n)] = {
            "by_cp": {cp: ts[0] if len(set(ts)) == 1 else ts for cp, ts in toks.items()},
            "all_equal": len(flat) == 1 if flat else None,
        }
    return out


def ratios(ttft: dict, cp_sizes: list[int], lengths: list[int]) -> dict:
    """TTFT(base C_p) / TTFT(C_p) per length, base = the first of --cp-sizes."""
    base, out = str(cp_sizes[0]), {}
    for cp in cp_sizes[1:]:
        per = {}
        for n in lengths:
            t0, t1 = ttft[base][str(n)].get("seconds"), ttft[str(cp)][str(n)].get("seconds")
            per[str(n)] = t0 / t1 if t0 and t1 else None
        out[f"ttft_cp{base}_over_cp{cp}"] = per
    return out


# ---------------------------------------------------------------- output
def fmt_s(r: dict) -> str:
    if "seconds" not in r:
        return "error"
    return f"{r['seconds']:.2f}" + ("*" if r.get("contended") else "")


def ttft_table(ttft: dict, rat: dict, toks: dict, a: argparse.Namespace) -> str:
    base = a.cp_sizes[0]
    head = (
        ["prompt tokens"]
        + [f"TTFT C_p={cp} (s)" for cp in a.cp_sizes]
        + [f"speedup C_p={base}/{cp}" for cp in a.cp_sizes[1:]]
        + ["rank CPU/wall C_p=" + str(cp) for cp in a.cp_sizes[1:]]
        + ["first token (same?)"]
    )
    rows = [head]
    for n in a.lengths:
        row = [str(n)] + [fmt_s(ttft[str(cp)][str(n)]) for cp in a.cp_sizes]
        for cp in a.cp_sizes[1:]:
            x = rat[f"ttft_cp{base}_over_cp{cp}"][str(n)]
            row.append(f"{x:.2f}x" if x else "-")
        for cp in a.cp_sizes[1:]:
            u = ttft[str(cp)][str(n)].get("rank_cpu_over_wall")
            row.append("/".join(f"{x:.2f}" for x in u) if u else "-")
        t = toks[str(n)]
        tok = ",".join(str(v) for v in dict.fromkeys(str(v) for v in t["by_cp"].values()))
        row.append(f"{tok} ({'yes' if t['all_equal'] else 'no' if t['all_equal'] is False else '-'})")
        rows.append(row)
    return grid(rows)


def balance_text(bal: dict, cps: list[int], lengths: list[int]) -> str:
    rows = [["layout", "prompt tokens"] + [f"C={c}" for c in cps]]
    for layout in LAYOUTS:
        for n in lengths:
            rows.append(
                [layout, str(n)] + [f"{bal[layout][str(n)][str(c)]['busiest_over_average']:.6f}" for c in cps]
            )
    return grid(rows)


def grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def plot(ttft: dict, rat: dict, bal: dict, a: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))
    lengths = sorted(a.lengths)
    for i, cp in enumerate(a.cp_sizes):
        pts = [(n, ttft[str(cp)][str(n)]["seconds"]) for n in lengths if "seconds" in ttft[str(cp)][str(n)]]
        if pts:
            ax1.plot(
                *zip(*pts),
                "o-",
                color=f"C{i}",
                label=f"C_p={cp} ({cp} rank{'s' if cp > 1 else ''} x 1 thread)",
            )
    base_pts = [
        (n, ttft[str(a.cp_sizes[0])][str(n)]["seconds"])
        for n in lengths
        if "seconds" in ttft[str(a.cp_sizes[0])][str(n)]
    ]
    if base_pts and len(a.cp_sizes) > 1:  # perfect scaling from the baseline to the largest C_p
        f = a.cp_sizes[-1] / a.cp_sizes[0]
        ax1.plot(
            [n for n, _ in base_pts],
            [t / f for _, t in base_pts],
            ":",
            color="gray",
            lw=1,
            label=f"C_p={a.cp_sizes[0]} / {f:g} (perfect scaling)",
        )
    qb = "" if a.query_block == 256 else f", query block {a.query_block}"
    ax1.set(
        xscale="log",
        yscale="log",
        title=f"Time to first token ({a.layout}, {a.cache} cache, chunk {a.chunk_size}{qb})",
        xlabel="prompt tokens",
        ylabel="seconds",
    )
    ax1.set_xticks(lengths, [str(n) for n in lengths])
    ax1.minorticks_off()
    ticks = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200)
    ax1.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ys = [r["seconds"] for cp in a.cp_sizes for r in ttft[str(cp)].values() if "seconds" in r]
    if ys:
        ax1.set_ylim(min(ys) / 1.5, max(ys) * 1.5)

    for i, (name, per) in enumerate(rat.items()):
        pts = [(n, per[str(n)]) for n in lengths if per[str(n)]]
        if pts:
            ax2.plot(
                *zip(*pts),
                "o-",
                color=f"C{i + 1}",
                label=name.replace("ttft_", "TTFT ").replace("_over_", " / ").replace("cp", "C_p="),
            )
            for n, x in pts:
                ax2.annotate(
                    f"{x:.2f}x", (n, x), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9
                )
    ceiling = min(os.cpu_count() or 1, max(a.cp_sizes)) / a.cp_sizes[0]
    ax2.axhline(ceiling, ls="--", color="k", lw=1, label=f"{ceiling:g}x ceiling ({os.cpu_count()} cores)")
    ax2.axhline(CLAIM_RATIO, ls="--", color="C3", lw=1, label=f"{CLAIM_RATIO}x claim")
    ax2.set(
        xscale="log",
        title="Speedup of time to first token",
        xlabel="prompt tokens",
        ylabel="TTFT ratio",
        ylim=(1, max([ceiling, 2] + [x for per in rat.values() for x in per.values() if x]) + 0.25),
    )
    ax2.set_xticks(lengths, [str(n) for n in lengths])
    ax2.minorticks_off()

    n = str(max(a.balance_lengths))
    cps = a.balance_cp
    w = 0.8 / len(LAYOUTS)
    for i, layout in enumerate(LAYOUTS):
        vals = [bal[layout][n][str(c)]["busiest_over_average"] for c in cps]
        xs = [j + (i - (len(LAYOUTS) - 1) / 2) * w for j in range(len(cps))]
        # bars start at 1 (perfect balance); the edge keeps a near-perfect bar visible as a line
        ax3.bar(
            xs,
            [v - 1 for v in vals],
            w,
            bottom=1,
            color=f"C{i}",
            edgecolor=f"C{i}",
            linewidth=2,
            label=layout,
        )
        for x, v in zip(xs, vals):
            ax3.annotate(
                f"+{100 * (v - 1):.2g}%",
                (x, v),
                textcoords="offset points",
                xytext=(0, 4),
                ha="center",
                va="bottom",
                rotation=90,
                fontsize=8,
            )
    ax3.set_xticks(range(len(cps)), [f"C={c}" for c in cps])
    top = max(bal[layout][n][str(c)]["busiest_over_average"] for layout in LAYOUTS for c in cps)
    ax3.set(
        title=f"Layout balance at {int(n)} tokens (pure accounting)",
        ylabel="busiest rank's query-key pairs / average",
        ylim=(0.95, top + 0.2),
    )
    for ax, loc in ((ax1, "upper left"), (ax2, "lower right"), (ax3, "upper left")):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc=loc)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run:  .venv/bin/python bench/prefill_cp.py   (about 5 minutes on 2 cores)",
    )
    p.add_argument(
        "--lengths",
        type=ints,
        default=[2048, 4096, 8192, 16384],
        help="prompt lengths in tokens, comma-separated (default 2048,4096,8192,16384); the headline ratio is at the longest",
    )
    p.add_argument(
        "--cp-sizes",
        type=ints,
        default=[1, 2],
        help="context-parallel sizes C_p to compare, comma-separated, the first is the baseline (default 1,2); one torch thread per rank",
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="interleave",
        help="how prompt tokens are split across ranks (default interleave, the only one glm_moe_dsa allows)",
    )
    p.add_argument(
        "--cache",
        choices=("full", "layer-split"),
        default="full",
        help="full: every rank keeps every layer's KV; layer-split: each rank keeps a block of layers and the owner "
        "broadcasts earlier chunks (default full)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=4096,
        help="prefill chunk in tokens; longer prompts run in several chunks (default 4096)",
    )
    p.add_argument(
        "--query-block",
        type=int,
        default=256,
        help="queries per attention/indexer block in each rank (PrefillWorkerConfig.query_block, default 256); "
        "the per-block temporaries are query_block x context",
    )
    p.add_argument(
        "--model",
        type=str,
        default=None,
        help="checkpoint directory (default: the built-in small glm_moe_dsa model)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "results",
        help="output folder for prefill_cp.json and prefill_cp.png (default bench/results)",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="timed prefills per length and C_p, best taken (default 2)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds allowed for rank start-up and for each prefill call (default 900)",
    )
    p.add_argument(
        "--idle-wait",
        type=float,
        default=300,
        help="before each timed prefill, wait up to this many seconds for other processes to use < "
        f"{IDLE_CORES} cores (the machine is shared); 0 disables (default 300)",
    )
    p.add_argument(
        "--balance-lengths",
        type=ints,
        default=[16, 131072],
        help="prompt lengths of the balance table, comma-separated (default 16,131072); the plot uses the longest",
    )
    p.add_argument(
        "--balance-cp",
        type=ints,
        default=[2, 4, 8],
        help="rank counts C of the balance table (default 2,4,8)",
    )
    a = p.parse_args(argv)
    if not a.lengths or not a.cp_sizes or a.repeats < 1 or a.chunk_size < 1 or a.query_block < 1:
        p.error(
            "need at least one length and one C_p, --repeats >= 1, --chunk-size >= 1 and --query-block >= 1"
        )
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, even without pip install -e
    from pdserve.cli import ensure_builtin_model

    model_dir = str(Path(a.model) if a.model else ensure_builtin_model())
    bal = balance_table(a.balance_cp, a.balance_lengths)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    bench = Bench(a, model_dir)
    try:
        bench.start()
        ttft = bench.measure()
        startup = bench.startup
    finally:
        bench.shutdown()
    toks = first_tokens(ttft, a.lengths)
    rat = ratios(ttft, a.cp_sizes, a.lengths)
    longest = str(max(a.lengths))
    headline = {f"{k}_at_{longest}": v[longest] for k, v in rat.items()}
    machine = {
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "threads_per_rank": 1,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_seconds": time.perf_counter() - t_start,
    }
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    config.update(
        model=model_dir,
        dtype="float32",
        moe_tp=False,
        page_size=PAGE_SIZE,
        num_slots=bench.worker.num_slots,
        warmup_tokens=[WARMUP_TOKENS, min(a.chunk_size, max(a.lengths))],
        sampling="greedy",
    )
    doc = {
        "claim": f"TTFT C_p=1 / C_p=2 >= {CLAIM_RATIO} at 16384 tokens (ceiling 2 on 2 cores)",
        "machine": machine,
        "config": config,
        "startup": startup,
        "ttft": ttft,
        "first_tokens": toks,
        "ratios": rat,
        "headline": headline,
        "balance": bal,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prefill_cp.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(ttft, rat, bal, a, a.out / "prefill_cp.png")
    print(ttft_table(ttft, rat, toks, a))
    if any(r.get("contended") for per in ttft.values() for r in per.values()):
        print(
            f"* contended: other processes took more than {NOISY_CORES} of the cores this (best) run's ranks needed"
            " (the machine is shared)"
        )
    print()
    print("layout balance: busiest rank's query-key pairs / average (1 = perfect)")
    print(balance_text(bal, a.balance_cp, a.balance_lengths))
    print()
    for name, r in headline.items():
        verdict = (
            "" if r is None else f"  (claim >= {CLAIM_RATIO}x: {'met' if r >= CLAIM_RATIO else 'NOT met'})"
        )
        print(
            f"{name.replace('ttft_', 'TTFT ').replace('_over_', ' / ').replace('cp', 'C_p=').replace('_at_', ' at ')}: "
            + (f"{r:.2f}x{verdict}" if r else "n/a")
        )
    for cp, err in bench.errors.items():
        print(f"C_p={cp} failed: {err.strip().splitlines()[-1]}")
    print(f"wrote {a.out / 'prefill_cp.json'} and {a.out / 'prefill_cp.png'}")


if __name__ == "__main__":
    main()
