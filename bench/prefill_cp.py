"""Prefill context-parallelism benchmark: time to first token of C_p ranks vs one rank with the same
total threads, and layout balance.

Claim measured: at 16k tokens a prefill instance with C_p = 2 ranks x 1 torch thread is no slower
to the first token than ONE rank with 2 threads (the same total cores; ratio >= 0.95), on the
built-in `small` model (glm_moe_dsa, DSA index_topk 256, float32 on CPU, interleave layout, full
cache, chunks of 4096). One rank with 1 thread is reported too (what context parallelism adds over
a rank that does not use the second core). The bound: the prefill's matmul FLOPs (2 x active
parameters per token; attention and the indexer not counted, so a lower bound of the work) over
the time, as a fraction of this CPU's measured float32 matmul rate with the same total threads.
  1. TTFT: one PrefillInstance per configuration (--configs, C_p x threads per rank; the prefill
     instance API directly, no HTTP), all started together (each rank is a process that loads the
     model) and warmed up (a 300-token prompt, then one full chunk). Then for every prompt length
     (2048, 4096, 8192, 16384) and repeat, one prefill per instance, alternating the order of the
     instances between repeats so that drift on a shared machine hits every one alike; the median
     of --repeats counts (min and max are recorded), and ratios are ratios of medians. TTFT is the wall time of
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
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

from common import (  # bench/ is on sys.path when a script runs
    IDLE_CORES,
    add_model_and_out,
    cpu_seconds,
    free_port,
    machine_info,
    resolve_model,
    system_busy_seconds,
    wait_until_idle,
)
from prefill_cp_report import (
    CLAIM_RATIO,
    LAYOUTS,
    balance_table,
    balance_text,
    first_tokens,
    plot,
    ratios,
    summary_rows,
    ttft_table,
)
from roofline import matmul_gflops, prefill_gflop

WARMUP_TOKENS = 300
PAGE_SIZE = 16
NOISY_CORES = 0.15  # a run is "contended" (flagged "*") when other processes took more than this of the cores its ranks needed


# ---------------------------------------------------------------- helpers
def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """The same random prompts as bench/engine.py (seed = length), so every C_p sees the same tokens."""
    import torch

    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- TTFT measurement
class Bench:
    """One started PrefillInstance per C_p, measured in alternation."""

    def __init__(self, a: argparse.Namespace, model_dir: str):
        from pdserve.prefill_server.worker_config import PrefillWorkerConfig

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
        self.instances: dict[str, object] = {}
        self.errors: dict[str, str] = {}
        self.startup: dict[str, dict] = {}

    def start(self) -> None:
        from pdserve.prefill_server.instance import PrefillInstance
        from pdserve.runtime.launcher import LaunchConfig

        for label in self.a.configs:
            cp, threads = map(int, label.split("x"))
            launch = LaunchConfig(
                cp,
                free_port(),
                threads_per_rank=threads,
                ready_timeout_s=self.a.timeout,
                collective_timeout_s=self.a.timeout,
            )
            print(
                f"  starting {label}: C_p={cp} x {threads} thread(s) (each rank process loads the model) ...",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            try:
                inst = PrefillInstance(
                    self.worker, launch, page_size=PAGE_SIZE, chunk_size=self.a.chunk_size
                ).start()
            except Exception:
                self._fail(label, "start")
                continue
            start_s = time.perf_counter() - t0
            self.instances[label] = inst
            vocab = inst.model_config.vocab_size
            warm = {}
            for n in (WARMUP_TOKENS, min(self.a.chunk_size, max(self.a.lengths))):  # first forward is slow
                r = self._prefill(label, f"warmup{n}", prompt_ids(n, 1, vocab))
                if "error" in r:
                    break
                warm[str(n)] = r["seconds"]
            self.startup[label] = {"start_seconds": start_s, "warmup_seconds": warm, "info": inst.info()}

    def _fail(self, label: str, what: str) -> dict:
        tb = traceback.format_exc()
        self.errors[label] = f"{what}: {tb}"
        print(f"  {label} {what} failed:\n{tb}", file=sys.stderr, flush=True)
        inst = self.instances.pop(label, None)
        if inst is not None:
            inst.shutdown()
        return {"error": tb.strip().splitlines()[-1], "traceback": tb}

    def _prefill(self, label: str, rid: str, ids: list[int], timed: bool = False) -> dict:
        inst = self.instances[label]
        cores = math.prod(map(int, label.split("x")))  # C_p x threads: the cores it uses
        pids = [r.pid for r in inst.rank_infos]
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
            return self._fail(label, f"prefill of {len(ids)} tokens")
        others = max(0.0, others / dt)
        return {
            "seconds": dt,
            "token": res.token,
            "rank_cpu_seconds": cpu,
            "rank_cpu_over_wall": [c / dt for c in cpu],
            # each rank's time in the CP collectives (all-gathers and broadcast waits, CPBackend.comm_s)
            # over its time in the prefill: the communication overhead as a share of the step
            "rank_comm_share": [c / t for c, t in zip(res.rank_comm_seconds, res.rank_seconds) if t],
            "other_processes_cores": others,
            "contended": others + cores > (os.cpu_count() or 1) + NOISY_CORES,
            "idle_wait": idle,
        }

    def measure(self) -> dict:
        labels = self.a.configs
        out: dict[str, dict] = {label: {} for label in labels}
        for label, err in self.errors.items():
            for n in self.a.lengths:
                out[label][str(n)] = {"error": "instance failed to start", "traceback": err}
        for n in self.a.lengths:
            ids = None
            runs: dict[str, list[dict]] = {label: [] for label in self.instances}
            for rep in range(self.a.repeats):
                order = list(self.instances) if rep % 2 == 0 else list(reversed(self.instances))
                for label in order:
                    if label not in self.instances:  # failed earlier in this loop
                        continue
                    if ids is None:
                        ids = prompt_ids(n, n, self.instances[label].model_config.vocab_size)
                    print(
                        f"  {label} prefill {n} tokens (repeat {rep + 1}/{self.a.repeats}) ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    r = self._prefill(label, f"r{n}-{rep}", ids, timed=True)
                    if "error" in r:
                        runs.pop(label)
                        out[label][str(n)] = r
                        continue
                    runs[label].append(r)
                    print(
                        f"    {r['seconds']:.2f} s, token {r['token']}, rank CPU/wall "
                        + ", ".join(f"{u:.2f}" for u in r["rank_cpu_over_wall"])
                        + f", other processes {r['other_processes_cores']:.2f} cores",
                        file=sys.stderr,
                        flush=True,
                    )
            for label, rs in runs.items():
                secs = [r["seconds"] for r in rs]
                med = statistics.median(secs)
                mid = min(rs, key=lambda r: abs(r["seconds"] - med))  # the run nearest the median
                out[label][str(n)] = dict(
                    mid,
                    seconds=med,
                    min_seconds=min(secs),
                    max_seconds=max(secs),
                    all_seconds=secs,
                    tokens=[r["token"] for r in rs],
                    tokens_per_s=n / med,
                )
        for label in labels:  # lengths never reached because the instance failed
            for n in self.a.lengths:
                out[label].setdefault(str(n), {"error": "skipped: the instance failed on an earlier prompt"})
        return out

    def shutdown(self) -> None:
        for inst in self.instances.values():
            inst.shutdown()
        self.instances.clear()


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
        "--configs",
        type=lambda s: [x for x in s.split(",") if x],
        default=["2x1", "1x2", "1x1"],
        help="instances to compare as C_p x threads per rank, comma-separated; the first is the context-parallel "
        "one, the others its baselines (default 2x1,1x2,1x1: C_p = 2 vs one rank with the same 2 threads vs one "
        "rank with 1 thread)",
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
    add_model_and_out(p, "prefill_cp")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed prefills per length and configuration; the median counts (default 3)",
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
    bad = [c for c in a.configs if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*", c)]
    if bad or not a.lengths or not a.configs or a.repeats < 1 or a.chunk_size < 1 or a.query_block < 1:
        p.error(
            "need --configs like 2x1,1x2 (C_p x threads), at least one length, --repeats >= 1, "
            "--chunk-size >= 1 and --query-block >= 1"
        )
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, even without pip install -e
    model_dir = resolve_model(a.model)
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
    rat = ratios(ttft, a.configs, a.lengths)
    longest = str(max(a.lengths))
    headline = {f"{k}_at_{longest}": v[longest] for k, v in rat.items()}
    # the bound: this CPU's float32 matmul rate with the CP instance's total threads (measured now,
    # with the ranks idle), against the prefill's linear-layer FLOPs over its median time
    cp, threads = map(int, a.configs[0].split("x"))
    peak = matmul_gflops(cp * threads)
    work = prefill_gflop(model_dir, int(longest))
    t_cp = ttft[a.configs[0]][longest].get("seconds")
    roofline = {
        "matmul_gflops_measured": peak,
        "threads": cp * threads,
        "prefill_linear_gflop": work,
        "achieved_gflops": work / t_cp if t_cp else None,
        "fraction_of_bound": work / t_cp / peak if t_cp else None,
        "tokens": int(longest),
    }
    machine = dict(
        machine_info(("torch",)),
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        wall_seconds=time.perf_counter() - t_start,
    )
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
        "claim": f"TTFT one rank x (C_p x t) threads / C_p ranks x t threads >= {CLAIM_RATIO} at 16384 tokens",
        "machine": machine,
        "config": config,
        "startup": startup,
        "ttft": ttft,
        "first_tokens": toks,
        "ratios": rat,
        "headline": headline,
        "balance": bal,
        "roofline": roofline,
    }
    doc["summary"] = summary_rows(doc, a)
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
            ""
            if r is None or not name.startswith(f"ttft_{a.configs[1]}_over_")
            else f"  (target >= {CLAIM_RATIO}x, same total threads: {'met' if r >= CLAIM_RATIO else 'NOT met'})"
        )
        print(
            f"{name.replace('ttft_', 'TTFT ').replace('_over_', ' / ').replace('_at_', ' at ')}: "
            + (f"{r:.2f}x{verdict}" if r else "n/a")
        )
    if roofline["fraction_of_bound"]:
        print(
            f"bound: {roofline['achieved_gflops']:.1f} GFLOP/s of linear-layer work at {longest} tokens = "
            f"{100 * roofline['fraction_of_bound']:.0f}% of the measured matmul rate ({peak:.1f} GFLOP/s, "
            f"{cp * threads} threads)"
        )
    for label, err in bench.errors.items():
        print(f"{label} failed: {err.strip().splitlines()[-1]}")
    print(f"wrote {a.out / 'prefill_cp.json'} and {a.out / 'prefill_cp.png'}")


if __name__ == "__main__":
    main()
