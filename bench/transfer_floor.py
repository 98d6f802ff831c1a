"""The verified floor of a hand-off by chunk size: can any verified transfer reach 80% of raw NIXL here?

bench/transfer.py holds the hand-off to >= 80% of the aggregate raw NIXL rate of its pairs, and
measures the floor beneath it: raw WRITEs whose receivers read every landed byte once, the one
thing invariant 8 (docs/design.md) adds to a raw WRITE. That floor WRITEs each pair whole and reads
after. A hand-off can do better only by overlapping the read with the copies: WRITE in chunks and
read each chunk as soon as it is notified, while it may still be in the cache and while the next
chunk is being copied (the hand-off's senders WRITE 32 MB chunks). This bench measures exactly
that, for every chunk size asked, over the same pairs carrying the same bytes:

    raw whole     one raw WRITE per pair, nothing read (bench/transfer.py's baseline)
    raw chunked   the same bytes in WRITEs of the chunk size, all in flight together, nothing read
    verified      the chunked WRITEs, each receiver reading every chunk once as it is notified

Each repeat runs the three in rotating order (the same phase of a noisy VM for all). The headline is
the best chunk size's verified median over the raw whole median: when it is below 80%, no hand-off
that reads what it received (with this transport, on these cores) can meet bench/transfer.py's
target, whatever its own overheads.

    python bench/transfer_floor.py                        2 pairs of 42 MB (the 16k-token hand-off's)
    python bench/transfer_floor.py --chunks-mb 0,32,4 --repeats 5

bench/ is on sys.path when a script runs (transfer_raw, common)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from common import idle_side, machine_info, spread
from transfer_raw import RawPairs

MB = 1 << 20
TARGET = 0.8  # bench/transfer.py's hand-off target, as a fraction of the aggregate raw rate
HANDOFF_PAIR_BYTES = 44040192  # the 16k-token hand-off's bytes per pair (transfer.json: pair_bytes)
LATENT_ROW_BYTES = 640  # the built-in small model's latent row (160 float32): chunks hold whole rows


def measure(pairs: int, pair_bytes: int, chunks: list[int], repeats: int, row_bytes: int) -> dict:
    """Seconds of every round: {"raw whole": [...], "chunks": {MB: {"raw": [...], "verified": [...]}}}
    (no chunked raw rounds for 0 MB: those are the raw whole ones)."""
    rp = RawPairs({(i, i): pair_bytes for i in range(pairs)}, row_bytes)
    try:
        times: dict = {"raw whole": [], "chunks": {c: {"raw": [], "verified": []} for c in chunks}}
        # (where its times go, WRITE size, verify) of each kind of round, run in rotating order
        kinds = [(times["raw whole"], 0, False)] + [
            (times["chunks"][c][k], c, k == "verified")
            for c in chunks
            for k in ("raw", "verified")
            if c or k == "verified"
        ]
        for i in range(repeats):
            for out, chunk, verify in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                out.append(rp.round(verify, int(chunk * MB)))
        return times
    finally:
        rp.close()


def summarize(times: dict, nbytes: int) -> dict:
    raw = statistics.median(times["raw whole"])
    out = {"raw_whole": dict(spread(times["raw whole"]), GBps_median=nbytes / raw / 1e9), "chunks": {}}
    for chunk, by_kind in times["chunks"].items():
        row = {}
        for kind, ts in by_kind.items():
            if ts:
                med = statistics.median(ts)
                row[kind] = dict(spread(ts), GBps_median=nbytes / med / 1e9, of_raw_whole=raw / med)
        out["chunks"][chunk] = row
    best = max(out["chunks"], key=lambda c: out["chunks"][c]["verified"]["of_raw_whole"])
    out["best_chunk_mb"], out["best_verified_of_raw_whole"] = (
        best,
        out["chunks"][best]["verified"]["of_raw_whole"],
    )
    return out


def summary_rows(res: dict, args) -> list[dict]:
    """The README table's row (bench/table.py)."""
    best, raw = res["best_chunk_mb"], res["raw_whole"]
    v = res["chunks"][best]["verified"]
    size = "whole pairs" if best == 0 else f"{best:g} MB chunks"
    return [
        {
            "claim": f"verified floor of a {args.pairs}-pair hand-off ({args.pair_bytes / MB:.0f} MB a pair): raw "
            "WRITEs whose receivers read every chunk once as it lands, at the best of chunk sizes "
            f"{', '.join('whole' if c == 0 else f'{c:g} MB' for c in res['chunks'])}",
            "result": f"{1000 * v['median']:.1f} ms median at {size} ({v['GBps_median']:.2f} GB/s)",
            "baseline": f"one raw WRITE per pair, nothing read, the same pairs and bytes, {args.repeats} rounds "
            "each interleaved, medians",
            "bound": f"{100 * res['best_verified_of_raw_whole']:.0f}% of the aggregate raw rate "
            f"({raw['GBps_median']:.2f} GB/s); the hand-off's target is {100 * TARGET:.0f}% of it",
            "target": f">= {100 * TARGET:.0f}% (else no verified hand-off can meet bench/transfer.py's target here)",
            "met": res["best_verified_of_raw_whole"] >= TARGET,
        }
    ]


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = list(res["chunks"])
    labels = ["whole" if c == 0 else f"{c:g} MB" for c in chunks]
    x = range(len(chunks))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    raw = [res["chunks"][c].get("raw", res["raw_whole"])["GBps_median"] for c in chunks]
    ver = [res["chunks"][c]["verified"]["GBps_median"] for c in chunks]
    ax.bar([i - 0.2 for i in x], raw, 0.4, label="raw, in chunks of this size")
    ax.bar([i + 0.2 for i in x], ver, 0.4, label="verified (each chunk read once as it lands)")
    whole = res["raw_whole"]["GBps_median"]
    ax.axhline(whole, c="k", lw=1, label=f"raw, one WRITE per pair ({whole:.2f} GB/s)")
    ax.axhline(TARGET * whole, ls="--", c="r", label="80% of it (the hand-off's target)")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("WRITE size")
    ax.set_ylabel("GB/s (medians)")
    ax.set_title(f"{res['pairs']} pairs, {res['pair_bytes'] / MB:.0f} MB each, at once")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pairs", type=int, default=2, help="sender -> receiver pairs at once (default 2)")
    ap.add_argument(
        "--pair-bytes",
        type=int,
        default=HANDOFF_PAIR_BYTES,
        help=f"bytes per pair (default {HANDOFF_PAIR_BYTES}: the 16k-token hand-off's on the built-in model)",
    )
    ap.add_argument(
        "--chunks-mb",
        default="0,32,16,8,4,2,1",
        help="WRITE sizes in MB, comma-separated; 0 = one WRITE per pair (default 0,32,16,8,4,2,1)",
    )
    ap.add_argument("--repeats", type=int, default=40, help="rounds of each kind; medians (default 40)")
    ap.add_argument(
        "--idle-wait", type=float, default=60, help="seconds to wait for an idle machine (default 60)"
    )
    ap.add_argument("--out", default="bench/results", help="output directory for transfer_floor.json/.png")
    args = ap.parse_args(argv)
    chunks = sorted({float(x) for x in args.chunks_mb.split(",") if x.strip()}, key=lambda c: (c != 0, -c))
    if args.pairs < 1 or args.pair_bytes < LATENT_ROW_BYTES or args.repeats < 1 or any(c < 0 for c in chunks):
        ap.error("--pairs, --repeats must be >= 1, --pair-bytes >= one row, --chunks-mb >= 0")
    chunks = [int(c) if c == int(c) else c for c in chunks]
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    idle = idle_side(args.idle_wait, "raw and verified rounds")
    times = measure(args.pairs, args.pair_bytes, chunks, args.repeats, LATENT_ROW_BYTES)
    res = {
        "pairs": args.pairs,
        "pair_bytes": args.pair_bytes,
        **summarize(times, args.pairs * args.pair_bytes),
    }
    print(f"raw, one WRITE per pair: {1000 * res['raw_whole']['median']:.1f} ms median")
    for c, row in res["chunks"].items():
        print(
            f"  {'whole' if c == 0 else f'{c:g} MB':>8}: "
            + ", ".join(
                f"{k} {1000 * r['median']:.1f} ms ({100 * r['of_raw_whole']:.0f}%)" for k, r in row.items()
            )
        )
    print(
        f"best verified: {100 * res['best_verified_of_raw_whole']:.0f}% of raw at chunk {res['best_chunk_mb']} MB"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "machine": dict(
            machine_info(("torch", "nixl-cu13")), UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES")
        ),
        "config": {k: getattr(args, k) for k in ("pairs", "pair_bytes", "chunks_mb", "repeats")},
        "idle_before": idle,
        **res,
        "summary": summary_rows(res, args),
    }
    (out / "transfer_floor.json").write_text(json.dumps(doc, indent=1))
    plot(res, out / "transfer_floor.png")
    print(f"wrote {out / 'transfer_floor.json'} and {out / 'transfer_floor.png'}")


if __name__ == "__main__":
    main()
