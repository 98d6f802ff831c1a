"""Decode context parallelism: step time and cache bytes per rank at long context.

Claim measured (article section 3.6): splitting the cache across the C_d ranks of a decode instance
costs little time. At 32k tokens of context, the DCP step time (W = 2, C_d = 2) over the plain
tensor-parallel step time (W = 2, C_d = 1) is at most 1.15 (the article measured 1.12 on 2 GPUs),
while each rank stores about half the latent cache (with a split index, half of everything).

Setup: the built-in `small` glm_moe_dsa model (index_topk 256), float32, one thread per rank, one
request whose 32k-token cache is filled with random entries (a decode step's cost does not depend
on the cached values), batch 1 and 4. Each configuration runs WARMUP untimed steps, then --steps
timed steps; the median step time is reported. Configurations are measured in rounds (every
configuration once per round, --rounds rounds) and each reports its best round: the first instance
started on a fresh machine gets memory laid out differently (huge pages), which skewed single runs
by up to 1.7x in either direction.

Run:  .venv/bin/python bench/decode_dcp.py      (about 5 minutes; bench/results/decode_dcp.json + .png)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import time
from pathlib import Path

import torch

from pdserve.cli import ensure_builtin_model
from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.rank_worker import DecodeWorkerConfig
from pdserve.engine.launcher import LaunchConfig

WARMUP = 3
CONFIGS = [  # name, W, C_d, index mode, comm, replicated q
    ("TP=2 (C_d=1)", 2, 1, "copy", "a2a", False),
    ("DCP=2 copy a2a", 2, 2, "copy", "a2a", False),
    ("DCP=2 copy ag_rs", 2, 2, "copy", "ag_rs", False),
    ("DCP=2 copy a2a repl-q", 2, 2, "copy", "a2a", True),
    ("DCP=2 split a2a", 2, 2, "split", "a2a", False),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_random_cache(inst: DecodeInstance, pages: list[int], n: int) -> None:
    cfg, g = inst.model_config, torch.Generator().manual_seed(0)
    kv = torch.randn(cfg.num_layers, n, cfg.kv_entry_dim, generator=g) * 0.5
    index = {layer: torch.randn(n, cfg.index_head_dim, generator=g) for layer in cfg.indexer_layers}
    inst.load(pages, kv, index)


def measure(model: str, name, tp, dcp, index_mode, comm, rq, context: int, batches: list[int], steps: int) -> dict:
    page = 64
    per_request = context + steps + WARMUP + 1
    slots = -(-per_request // page) * page * max(batches)
    worker = DecodeWorkerConfig(model, num_slots=slots, dcp_size=dcp, index_mode=index_mode, comm=comm, replicate_q=rq)
    with DecodeInstance(worker, LaunchConfig(tp, free_port(), threads_per_rank=1), page_size=page) as inst:
        out = {"cache_bytes_per_rank": inst.rank_infos[0]["cache_bytes"], "slots": slots}
        pages = [inst.allocator.allocate(per_request) for _ in range(max(batches))]
        for p in pages:
            fill_random_cache(inst, p, context)
        for b in batches:
            times = []
            for i in range(WARMUP + steps):
                t0 = time.perf_counter()
                inst.step([7] * b, pages[:b], [context + 1 + i] * b)
                times.append(time.perf_counter() - t0)
            out[f"batch{b}_ms"] = 1000 * statistics.median(times[WARMUP:])
        print(f"{name:24s} " + "  ".join(f"batch {b}: {out[f'batch{b}_ms']:7.2f} ms" for b in batches), flush=True)
        return out


def plot(results: dict, batches: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(batches)
    for i, bs in enumerate(batches):
        base = results[names[0]][f"batch{bs}_ms"]
        a.bar([x + i * width for x in range(len(names))], [results[n][f"batch{bs}_ms"] / base for n in names],
              width, label=f"batch {bs}")
    a.axhline(1.15, ls="--", c="r", label="1.15 target")
    a.set_xticks([x + width / 2 for x in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    a.set_ylabel("step time / TP=2 step time")
    a.set_title("decode step time at 32k context (W = 2)")
    a.legend(fontsize=8)
    b.bar(range(len(names)), [results[n]["cache_bytes_per_rank"] / results[n]["slots"] for n in names])
    b.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    b.set_ylabel("cache bytes per token on one rank")
    b.set_title("what one rank stores per token")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768, help="cached tokens per request (default 32768)")
    ap.add_argument("--batches", default="1,4", help="decode batch sizes, comma-separated (default 1,4)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per configuration (default 20)")
    ap.add_argument("--rounds", type=int, default=2, help="measure every configuration this many times, keep the best (default 2)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in small model)")
    ap.add_argument("--out", default="bench/results", help="output directory for decode_dcp.json/.png")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    model = args.model or str(ensure_builtin_model())
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for c in CONFIGS:
            r = measure(model, *c, args.context, batches, args.steps)
            best = results.setdefault(c[0], r)
            for b in batches:
                best[f"batch{b}_ms"] = min(best[f"batch{b}_ms"], r[f"batch{b}_ms"])
    base = results[CONFIGS[0][0]]
    ratios = {name: {f"batch{b}": r[f"batch{b}_ms"] / base[f"batch{b}_ms"] for b in batches} for name, r in results.items()}
    print("\nstep time / TP=2 step time:")
    for name, r in ratios.items():
        print(f"  {name:24s} " + "  ".join(f"{k}: {v:.3f}" for k, v in r.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_dcp.json").write_text(json.dumps({
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads_per_rank": 1,
                    "date": datetime.datetime.now().isoformat(timespec="seconds")},
        "config": {"context": args.context, "batches": batches, "steps": args.steps, "model": model},
        "results": results, "ratios_over_tp2": ratios,
        "headline": {"dcp2_copy_a2a_over_tp2_batch1": ratios["DCP=2 copy a2a"][f"batch{batches[0]}"]},
    }, indent=1))
    plot(results, batches, out / "decode_dcp.png")
    print(f"\nwrote {out / 'decode_dcp.json'} and {out / 'decode_dcp.png'}")


if __name__ == "__main__":
    main()
