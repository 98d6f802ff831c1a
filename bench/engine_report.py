"""bench/engine.py's report: the headline ratios, the text table, the PNG plot and the README table's
summary rows (imported by engine.py; bench/ is on sys.path when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path


def ratios(res: dict, a: argparse.Namespace) -> dict:
    out, val = {}, lambda kind, e, key, field: res[kind].get(e, {}).get(key, {}).get(field)
    b = str(max(a.decode_batches))
    o, t = val("decode", "ours", b, "tokens_per_s"), val("decode", "transformers", b, "tokens_per_s")
    out[f"decode_tokens_per_s_batch{b}_ours_over_transformers"] = o / t if o and t else None
    if len(a.lengths) >= 2:
        lo, hi = (str(n) for n in sorted(a.lengths)[-2:])
        m_lo, m_hi = val("prefill", "ours", lo, "peak_mb"), val("prefill", "ours", hi, "peak_mb")
        out[f"ours_prefill_peak_mb_{hi}_over_{lo}"] = m_hi / m_lo if m_lo and m_hi else None
    return out


def fmt(r: dict, field: str) -> str:
    if "error" in r:
        return {"out of memory": "OOM", "timeout": "timeout"}.get(r["error"], "error")
    return f"{r[field]:.1f}" if field in r else "-"


def table(res: dict) -> str:
    rows = [("metric", "ours", "transformers", "ours/transformers")]
    specs = [
        ("prefill", "tokens_per_s", "prefill tok/s @{}"),
        ("prefill", "peak_mb", "prefill peak MB @{}"),
        ("decode", "tokens_per_s", "decode tok/s batch {}"),
    ]
    for kind, field, name in specs:
        for key, r_ours in res[kind]["ours"].items():
            r_hf = res[kind].get("transformers", {}).get(key, {})
            ratio = r_ours.get(field, 0) / r_hf[field] if r_hf.get(field) and r_ours.get(field) else None
            rows.append(
                (
                    name.format(key),
                    fmt(r_ours, field),
                    fmt(r_hf, field) if r_hf else "-",
                    f"{ratio:.2f}x" if ratio else "-",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def plot(res: dict, path: Path, context: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    for i, e in enumerate(res["prefill"]):
        for ax, field in ((ax1, "tokens_per_s"), (ax3, "peak_mb")):
            pts = [(int(n), r[field]) for n, r in res["prefill"][e].items() if field in r]
            if pts:
                ax.plot(*zip(*pts), "o-", color=f"C{i}", label=e)
            for n, r in res["prefill"][e].items():
                if "error" in r:
                    ax.annotate(
                        fmt(r, field),
                        (int(n), 0.02),
                        xycoords=("data", "axes fraction"),
                        color=f"C{i}",
                        ha="center",
                    )
        batches = list(res["decode"][e])
        ax2.bar(
            [j + 0.38 * i for j in range(len(batches))],
            [res["decode"][e][b].get("tokens_per_s", 0) for b in batches],
            0.38,
            color=f"C{i}",
            label=e,
        )
    ax2.set_xticks([j + 0.19 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ours = [(int(n), r["peak_mb"]) for n, r in res["prefill"]["ours"].items() if "peak_mb" in r]
    if ours:
        n0, m0 = ours[0]
        xs = [n for n, _ in ours]
        ax3.plot(xs, [m0 * n / n0 for n in xs], "k--", lw=1, label="linear reference")
    lengths = sorted({int(n) for r in res["prefill"].values() for n in r})
    ax1.set(
        xscale="log",
        title="Prefill throughput (1 request)",
        xlabel="prompt tokens",
        ylabel="tokens/s",
        ylim=(0, None),
    )
    ax2.set(title=f"Decode throughput ({context}-token context)", ylabel="tokens/s")
    ax3.set(
        xscale="log",
        yscale="log",
        title="Prefill peak RSS growth over loaded model",
        xlabel="prompt tokens",
        ylabel="MB",
    )
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in (ax1, ax3):
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
    ax3.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    ax3.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _decode_bound(roof: dict) -> str:
    text = (
        f"{100 * roof['fraction_of_bound']:.0f}% of memory bandwidth "
        f"({roof['bound_ms_per_step']:.2f} ms/step bound at memcpy's {roof['memcpy_GBps_2_threads']:.1f} GB/s, "
        f"read + write); {100 * roof['fraction_of_read_bound']:.0f}% of a pure read stream's "
        f"({roof['read_bound_ms_per_step']:.2f} ms); {100 * roof['fraction_of_memcpy_read_rate']:.0f}% of "
        f"a copy's read rate alone"
    )
    if roof.get("call_floor_ms_per_step"):
        text += (
            f"; {roof['torch_calls_per_step']} torch calls per step, "
            f"{roof['call_floor_ms_per_step']:.2f} ms at an empty call's cost"
        )
    return text


def decode_bound_line(roof: dict, context: int) -> str:
    step = roof["bytes_per_step"]["total"]
    text = (
        f"decode batch 1 at {context} tokens: {roof['ms_per_step']:.2f} ms per step vs the memory bound "
        f"{roof['bound_ms_per_step']:.2f} ms ({step / 2**20:.1f} MiB read at memcpy's "
        f"{roof['memcpy_GBps_2_threads']:.1f} GB/s, read + write) = {100 * roof['fraction_of_bound']:.0f}% "
        f"of the bound (target >= 70%; medians over {roof['windows']} windows of steps, each paired with "
        f"its own bandwidths); a pure read stream ({roof['read_GBps_2_threads']:.1f} GB/s): "
        f"{100 * roof['fraction_of_read_bound']:.0f}%; a copy's read rate alone "
        f"({roof['memcpy_read_GBps_2_threads']:.1f} GB/s, no bound): {100 * roof['fraction_of_memcpy_read_rate']:.0f}%"
    )
    if roof.get("call_floor_ms_per_step"):
        text += (
            f"\n    the step makes {roof['torch_calls_per_step']} torch calls; at {roof['call_us']:.2f} µs for an "
            f"empty one that is {roof['call_floor_ms_per_step']:.2f} ms before any data is read"
        )
    return text


def _weight_bound_row(wb: dict, a: argparse.Namespace) -> dict | None:
    o, t, roof = wb["ours"], wb.get("transformers", {}), wb["roofline"]
    if not o.get("tokens_per_s") or not roof or not roof["fraction_of_bound"]:
        return None
    vs = (
        f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x ({o['tokens_per_s']:.1f} vs {t['tokens_per_s']:.1f})"
        if t.get("tokens_per_s")
        else f"{o['tokens_per_s']:.1f} tok/s"
    )
    return {
        "claim": f"decode tokens/s, batch 1, {a.decode_context}-token context, {wb['size']} preset "
        f"({roof['bytes_per_step']['total'] / 2**20:.0f} MiB read per step)",
        "result": vs,
        "baseline": f"transformers on the same checkpoint, 2 threads each, {a.decode_steps} steps each, medians",
        "bound": _decode_bound(roof),
        "target": ">= 70% of the bound",
        "met": roof["fraction_of_bound"] >= 0.7,
    }


def summary_rows(doc: dict, a: argparse.Namespace) -> list[dict]:
    """The README table's rows (bench/table.py)."""
    rows, d, p = [], doc["decode"], doc["prefill"]
    same = f"transformers on the same checkpoint, 2 threads each, {a.repeats} prefill runs / {a.decode_steps} steps each, medians"
    for b in a.decode_batches:
        o, t = d["ours"].get(str(b), {}), d.get("transformers", {}).get(str(b), {})
        if o.get("tokens_per_s") and t.get("tokens_per_s"):
            rows.append(
                {
                    "claim": f"decode tokens/s, batch {b}, {a.decode_context}-token context",
                    "result": f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x ({o['tokens_per_s']:.1f} vs "
                    f"{t['tokens_per_s']:.1f})",
                    "baseline": same,
                    "bound": None
                    if b != 1 or not doc["roofline_decode_batch1"]["fraction_of_bound"]
                    else _decode_bound(doc["roofline_decode_batch1"]),
                    "target": ">= 70% of the bound" if b == 1 else None,
                    "met": (doc["roofline_decode_batch1"]["fraction_of_bound"] or 0) >= 0.7
                    if b == 1
                    else None,
                }
            )
            if b == 1 and doc.get("weight_bound_decode_batch1"):
                row = _weight_bound_row(doc["weight_bound_decode_batch1"], a)
                rows.extend([row] if row else [])
    n = str(max(a.lengths))
    o, t = p["ours"].get(n, {}), p.get("transformers", {}).get(n, {})
    if o.get("seconds"):
        rows.append(
            {
                "claim": f"prefill of {n} tokens",
                "result": f"{o['seconds']:.2f} s"
                + (
                    f" vs {t['seconds']:.2f} s ({t['seconds'] / o['seconds']:.2f}x)"
                    if t.get("seconds")
                    else f" vs transformers: {t['error']}"
                    if t.get("error")
                    else ""
                )
                + "".join(
                    f"; peak memory {k.split('_mb_')[1].replace('_over_', ' / ')} tokens: {v:.2f}x"
                    for k, v in doc["ratios"].items()
                    if k.startswith("ours_prefill_peak_mb") and v
                ),
                "baseline": same,
                "bound": None,
                "target": None,
                "met": None,
            }
        )
    return rows
