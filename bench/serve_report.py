"""bench/serve.py's report: the results table, the plot, the prefill-bound ceiling and the README
rows. bench/ is on sys.path when a script runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def median(d: dict, key: str) -> float | None:
    return (d.get(key) or {}).get("median")


def fmt(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def table(stack: dict, hf: dict) -> str:
    cols = [
        ("request_throughput", "req/s", 2),
        ("output_throughput", "out tok/s", 1),
        ("median_ttft_ms", "TTFT p50", 0),
        ("p99_ttft_ms", "TTFT p99", 0),
        ("median_itl_ms", "ITL p50", 1),
        ("p99_itl_ms", "ITL p99", 1),
        ("request_goodput", "goodput/s", 2),
    ]
    rows = [("run", *(c[1] for c in cols), "failed")]
    for name, lv in [*stack.items(), *hf.items()]:
        r = lv["runs"][len(lv["runs"]) // 2] if lv.get("runs") else lv
        if "error" in r:
            rows.append((name, r["error"], *[""] * len(cols)))
            continue
        rows.append((name, *(fmt(r.get(k), nd) for k, _, nd in cols), str(r.get("failed", 0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stack, hf = doc["stack"]["random"], doc["transformers"]
    conc = [c for c in doc["config"]["concurrency"] if median(stack.get(f"c{c}", {}), "output_throughput")]
    batches = [b for b in doc["config"]["hf_batches"] if median(hf.get(f"batch{b}", {}), "output_throughput")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    for src, keys, lab, mk in (
        (stack, [f"c{c}" for c in conc], "pdserve up (concurrency)", "o-"),
        (hf, [f"batch{b}" for b in batches], "transformers (static batch)", "s--"),
    ):
        xs = conc if src is stack else batches
        med = [median(src[k], "output_throughput") for k in keys]
        lo = [m - src[k]["output_throughput"]["min"] for m, k in zip(med, keys)]
        hi = [src[k]["output_throughput"]["max"] - m for m, k in zip(med, keys)]
        ax.errorbar(xs, med, yerr=[lo, hi], fmt=mk, capsize=3, label=lab)
    ax.set(title="Output tokens/s (median, min-max)", xlabel="concurrent requests / batch", ylim=(0, None))
    ax = axes[1]
    for src, keys, xs, lab, mk in (
        (stack, [f"c{c}" for c in conc], conc, "pdserve up", "o-"),
        (hf, [f"batch{b}" for b in batches], batches, "transformers", "s--"),
    ):
        ax.plot(xs, [median(src[k], "median_ttft_ms") for k in keys], mk, label=f"{lab} TTFT p50")
    ax.axhline(doc["config"]["slo_ttft_ms"], color="grey", ls=":", label="TTFT SLO")
    ax.set(title="Time to first token", xlabel="concurrent requests / batch", ylabel="ms", yscale="log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(doc["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def prefill_ceiling(rnd: dict, level: str, instances: int = 1, cp: int = 1) -> dict | None:
    """What the stack's output tokens/s at `level` could be if decoding cost nothing: the level's
    output tokens over the time its prompts take to prefill, at the prefill rate of concurrency 1
    (its input tokens over the sum of its TTFTs: one prompt at a time on one instance, each of its
    ranks on a core of its own; the TTFT also holds the hand-off and the first step, so the rate is a
    slight underestimate) times the instances that can prefill at once with a core per rank (all of
    them, up to cores / C_p). On a machine whose cores the prefill saturates, concurrency adds no
    prefill throughput beyond that, so this bounds what any decode speed-up can give."""
    c1, lv = rnd.get("c1"), rnd.get(level)
    if not c1 or not lv:
        return None
    r1, r = c1["runs"][0], lv["runs"][0]
    if not r1.get("mean_ttft_ms") or not r1.get("completed") or not r.get("total_input_tokens"):
        return None
    parallel = max(1, min(instances, (os.cpu_count() or 1) // cp))
    rate = r1["total_input_tokens"] / (r1["mean_ttft_ms"] / 1000 * r1["completed"])
    return {
        "prefill_tok_s_c1": rate,
        "instances_at_once": parallel,
        "output_tok_s": r["total_output_tokens"] * rate * parallel / r["total_input_tokens"],
    }


def _topology(a: argparse.Namespace) -> str:
    n, cp = getattr(a, "prefill_instances", 1), a.prefill_cp
    return (
        f"{n} prefill instance{'s' * (n > 1)} of C_p = {cp}, decode W = {a.decode_tp}, C_d = {a.decode_dcp}"
    )


def _times(instances: int) -> str:
    return "" if instances == 1 else f" x {instances} instances at once"


def summary_rows(doc: dict, a: argparse.Namespace) -> list[dict]:
    """The README table's rows (bench/table.py)."""
    h, rnd, hf = doc["headline"], doc["stack"]["random"], doc["transformers"]
    runs = [
        run
        for part in ("random", "rates", "shared_prefix")
        for lv in doc["stack"][part].values()
        for run in lv["runs"]
    ]
    sent = sum(run.get("completed") or 0 for run in runs) + h["failed_requests"]
    rows = [
        {
            "claim": "SGLang's bench_serving against `pdserve up`: requests completed, every level",
            "result": f"{sent - h['failed_requests']}/{sent}" if runs else None,
            "baseline": None,
            "bound": None,
            "target": "no failures",
            "met": (h["failed_requests"] == 0) if runs else None,
        }
    ]
    ratio = h["stack_over_hf_best_output_tok_s"]
    if ratio:
        rows.append(
            {
                "claim": f"output tokens/s at concurrency {a.headline_concurrency}, {a.prompts} random prompts "
                f"(input <= {a.input_len}, output <= {a.output_len} tokens); {_topology(a)}",
                "result": f"{ratio:.2f}x ({h['stack_output_tok_s']:.1f} vs {h['hf_best_output_tok_s']:.1f} tok/s)",
                "baseline": f"transformers generate, best static batch ({h['hf_best_batch']} of {a.hf_batches}), "
                f"same prompts, 2 threads, {a.repeats} run(s) each, medians",
                "bound": None
                if not h.get("prefill_ceiling")
                else f"prefill-bound ceiling {h['prefill_ceiling']['output_tok_s']:.1f} tok/s "
                f"({h['prefill_ceiling']['output_tok_s'] / h['hf_best_output_tok_s']:.2f}x; decode free, prefill at "
                f"the c=1 rate {h['prefill_ceiling']['prefill_tok_s_c1']:.0f} tok/s"
                f"{_times(h['prefill_ceiling'].get('instances_at_once', 1))}): "
                f"{100 * h['stack_output_tok_s'] / h['prefill_ceiling']['output_tok_s']:.0f}% of it",
                "target": ">= 5x",
                "met": ratio >= 5,
            }
        )
    c1, b1 = rnd.get("c1"), hf.get("batch1")
    if c1 and b1 and median(c1, "median_ttft_ms") and median(b1, "median_ttft_ms"):
        rows.append(
            {
                "claim": "TTFT p50 at concurrency 1, the random set",
                "result": f"{median(c1, 'median_ttft_ms'):.0f} ms vs {median(b1, 'median_ttft_ms'):.0f} ms",
                "baseline": "transformers generate, batch 1, same prompts",
                "bound": None,
                "target": None,
                "met": None,
            }
        )
    return rows
