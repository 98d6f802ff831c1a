"""bench/prefill_cp.py's report: first tokens and ratios from the measured times, the text tables
and the PNG plot (imported by prefill_cp.py; bench/ is on sys.path when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

CLAIM_RATIO = 0.95  # C_p ranks x t threads vs one rank x C_p*t threads: no slower (5% noise allowed)
LAYOUTS = ("interleave", "zigzag", "contiguous")


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


def first_tokens(ttft: dict, lengths: list[int]) -> dict:
    """Per length: every configuration's first token (every repeat agreed) and whether all agree."""
    out = {}
    for n in lengths:
        toks = {c: r[str(n)]["tokens"] for c, r in ttft.items() if "tokens" in r[str(n)]}
        flat = {t for ts in toks.values() for t in ts}
        out[str(n)] = {
            "by_config": {c: ts[0] if len(set(ts)) == 1 else ts for c, ts in toks.items()},
            "all_equal": len(flat) == 1 if flat else None,
        }
    return out


def ratios(ttft: dict, configs: list[str], lengths: list[int]) -> dict:
    """TTFT(baseline) / TTFT(the CP configuration, the first of --configs) per length: > 1 = CP is faster."""
    cp, out = configs[0], {}
    for base in configs[1:]:
        per = {}
        for n in lengths:
            t0, t1 = ttft[base][str(n)].get("seconds"), ttft[cp][str(n)].get("seconds")
            per[str(n)] = t0 / t1 if t0 and t1 else None
        out[f"ttft_{base}_over_{cp}"] = per
    return out


def summary_rows(doc: dict, a: argparse.Namespace) -> list[dict]:
    """The README table's rows (bench/table.py)."""
    n = str(max(a.lengths))
    cpl = a.configs[0]
    rows = []
    for k, v in doc["headline"].items():
        base = k.split("_over_")[0].removeprefix("ttft_")
        t = doc["ttft"]
        rows.append(
            {
                "claim": f"TTFT at {n} tokens, C_p x threads {cpl} vs {base}",
                "result": None
                if v is None
                else f"{v:.2f}x ({t[base][n]['seconds']:.2f} s / {t[cpl][n]['seconds']:.2f} s)",
                "baseline": f"one instance {base} (C_p x threads), same prompt, {a.repeats} runs each, medians",
                "bound": None
                if not doc["roofline"]["fraction_of_bound"]
                else f"{100 * doc['roofline']['fraction_of_bound']:.0f}% of the matmul rate "
                f"({doc['roofline']['matmul_gflops_measured']:.0f} GFLOP/s)",
                "target": f">= {CLAIM_RATIO}" if base == a.configs[1] else None,
                "met": (v >= CLAIM_RATIO) if (v is not None and base == a.configs[1]) else None,
            }
        )
    share = doc["ttft"][cpl][n].get("rank_comm_share")
    if share:
        rows.append(
            {
                "claim": f"CP communication share of the prefill step at {n} tokens ({cpl})",
                "result": f"{100 * sum(share) / len(share):.1f}% (ranks: "
                + ", ".join(f"{100 * x:.1f}%" for x in share)
                + ")",
                "baseline": "time in the CP all-gathers and broadcast waits over the rank's prefill time",
                "bound": None,
                "target": None,
                "met": None,
            }
        )
    return rows


# ---------------------------------------------------------------- output
def fmt_s(r: dict) -> str:
    if "seconds" not in r:
        return "error"
    spread = f" [{r['min_seconds']:.2f}-{r['max_seconds']:.2f}]" if "min_seconds" in r else ""
    return f"{r['seconds']:.2f}{spread}" + ("*" if r.get("contended") else "")


def ttft_table(ttft: dict, rat: dict, toks: dict, a: argparse.Namespace) -> str:
    cp = a.configs[0]
    head = (
        ["prompt tokens"]
        + [f"TTFT {c} (s, median)" for c in a.configs]
        + [f"{b} / {cp}" for b in a.configs[1:]]
        + [f"rank CPU/wall {cp}", f"comm share {cp}", "first token (same?)"]
    )
    rows = [head]
    for n in a.lengths:
        row = [str(n)] + [fmt_s(ttft[c][str(n)]) for c in a.configs]
        for b in a.configs[1:]:
            x = rat[f"ttft_{b}_over_{cp}"][str(n)]
            row.append(f"{x:.2f}x" if x else "-")
        u = ttft[cp][str(n)].get("rank_cpu_over_wall")
        row.append("/".join(f"{x:.2f}" for x in u) if u else "-")
        c = ttft[cp][str(n)].get("rank_comm_share")
        row.append("/".join(f"{100 * x:.0f}%" for x in c) if c else "-")
        t = toks[str(n)]
        tok = ",".join(str(v) for v in dict.fromkeys(str(v) for v in t["by_config"].values()))
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
    for i, c in enumerate(a.configs):
        pts = [(n, ttft[c][str(n)]["seconds"]) for n in lengths if "seconds" in ttft[c][str(n)]]
        if pts:
            cp, t = c.split("x")
            ax1.plot(*zip(*pts), "o-", color=f"C{i}", label=f"{c}: C_p={cp} x {t} thread(s), median")
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
    ys = [r["seconds"] for c in a.configs for r in ttft[c].values() if "seconds" in r]
    if ys:
        ax1.set_ylim(min(ys) / 1.5, max(ys) * 1.5)

    for i, (name, per) in enumerate(rat.items()):
        pts = [(n, per[str(n)]) for n in lengths if per[str(n)]]
        if pts:
            ax2.plot(
                *zip(*pts),
                "o-",
                color=f"C{i + 1}",
                label=name.replace("ttft_", "TTFT ").replace("_over_", " / "),
            )
            for n, x in pts:
                ax2.annotate(
                    f"{x:.2f}x", (n, x), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=9
                )
    ceiling = 1.0
    ax2.axhline(ceiling, ls="--", color="k", lw=1, label="1x: as fast as the baseline")
    ax2.axhline(CLAIM_RATIO, ls="--", color="C3", lw=1, label=f"{CLAIM_RATIO}x target (same total threads)")
    ax2.set(
        xscale="log",
        title=f"TTFT of each baseline / TTFT of {a.configs[0]}",
        xlabel="prompt tokens",
        ylabel="TTFT ratio",
        ylim=(0, max([ceiling, 2] + [x for per in rat.values() for x in per.values() if x]) + 0.25),
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
