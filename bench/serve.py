"""Serving benchmark: the whole stack (`pdserve up`) vs Hugging Face transformers' `generate`.

Measured (issue 6 item 6): requests per second, output tokens per second, time to first token
(TTFT) and inter-token latency (ITL) p50/p99 of `pdserve up --prefill-cp 2 --decode-tp 2
--decode-dcp 2` on the built-in `small` glm_moe_dsa model, at concurrency 1, 8 and 32, streaming
through the OpenAI-compatible `/v1/completions` endpoint, next to transformers' `generate` on the
same prompts in one process (batch 1 sequentially, and all prompts as one left-padded batch).

Prompts: --prompts deterministic prompts of random token ids (seeded, ids 1..vocab-1, so never the
EOS id 0), lengths spread geometrically over --min-len..--max-len and shuffled; every request asks
for exactly --max-tokens tokens (temperature 0, the router's `ignore_eos` extension; transformers:
greedy, min_new_tokens = max_new_tokens). Prompts go in as token ids, so both sides see the same ids.

Stack: `python -m pdserve.cli up` as a subprocess on a free port with its logs in a temporary
directory; this script waits for its "ready:" line, sends --warmup untimed requests, then for every
concurrency C sends all prompts through C client tasks (httpx, one connection each; a task takes
the next prompt when its request ends). TTFT: from sending the request to the first SSE chunk that
carries a token (`return_token_ids`); ITL: the gaps between later token-carrying chunks (a chunk
with k tokens, which happens when their text is an incomplete UTF-8 sequence, counts as k gaps of
gap / k). Throughput: all output tokens (requests) over the wall time from the first send to the
last stream end. SIGTERM stops the stack at the end (its launcher stops every child).
Transformers: a fresh subprocess (bench/serve_hf.py) with torch.set_num_threads(2), a
14 GiB address-space cap and --timeout; a streamer timestamps every generation step, which gives
TTFT (start of `generate` to the first new token) and ITL for batch 1 and for the padded batch.
The stack runs 1 torch thread in each of its 4 rank processes (2 prefill, 2 decode) plus the
router, on the same cores.

Run:  .venv/bin/python bench/serve.py      (a few minutes; bench/results/serve.json and serve.png)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from common import add_model_and_out, resolve_model  # bench/ is on sys.path when a script runs
from serve_hf import MEM_CAP, run_hf
from serve_stack import StackProcess, make_prompts, run_stack


# ---------------------------------------------------------------- report
def agreement(a_ids: list, b_ids: list) -> dict:
    """Requests whose greedy outputs are identical, and the mean common-prefix length."""
    pairs = {i: (x, y) for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x is not None and y is not None}
    prefix = {
        i: next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        for i, (x, y) in pairs.items()
    }
    return {
        "compared": len(pairs),
        "identical": sum(x == y for x, y in pairs.values()),
        "mean_common_prefix": sum(prefix.values()) / len(prefix) if prefix else None,
        "differing": [
            {"prompt": i, "first_difference_at": prefix[i]} for i, (x, y) in pairs.items() if x != y
        ],
    }


def ratios(stack: dict, hf: dict, conc: list[int]) -> dict:
    out = {}
    get = lambda d, k: d.get(k) if isinstance(d, dict) else None  # noqa: E731
    b1, bb = hf.get("batch1", {}), hf.get("batch", {})
    for c in conc:
        s = stack.get(str(c), {})
        if get(s, "output_tokens_per_s") and get(b1, "output_tokens_per_s"):
            out[f"stack_c{c}_over_hf_batch1_output_tokens_per_s"] = (
                s["output_tokens_per_s"] / b1["output_tokens_per_s"]
            )
    c_hi = str(max(conc))
    if get(stack.get(c_hi, {}), "output_tokens_per_s") and get(bb, "output_tokens_per_s"):
        out[f"stack_c{c_hi}_over_hf_padded_batch_output_tokens_per_s"] = (
            stack[c_hi]["output_tokens_per_s"] / bb["output_tokens_per_s"]
        )
    s1 = stack.get(str(min(conc)), {})
    for k in ("ttft_p50_ms", "itl_p50_ms"):
        if get(s1, k) and get(b1, k):
            out[f"stack_c{min(conc)}_over_hf_batch1_{k}"] = s1[k] / b1[k]
    if get(stack.get(c_hi, {}), "requests_per_s") and get(s1, "requests_per_s"):
        out[f"stack_requests_per_s_c{c_hi}_over_c{min(conc)}"] = (
            stack[c_hi]["requests_per_s"] / s1["requests_per_s"]
        )
    return out


def fmt(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def table(stack: dict, hf: dict) -> str:
    cols = (
        "requests_per_s",
        "output_tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "e2e_p50_ms",
    )
    rows = [
        (
            "run",
            "req/s",
            "out tok/s",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "ITL p50 ms",
            "ITL p99 ms",
            "e2e p50 ms",
            "errors",
        )
    ]
    for c, r in stack.items():
        rows.append(
            (
                f"stack c={c}",
                *(fmt(r.get(k), 2 if k == "requests_per_s" else 1) for k in cols),
                str(len(r.get("errors", []))),
            )
        )
    for name, label in (("batch1", "transformers batch 1"), ("batch", "transformers padded batch")):
        r = hf.get(name)
        if r is None:
            continue
        if "error" in r:
            rows.append((label, r["error"], *[""] * 7))
        else:
            rows.append((label, *(fmt(r.get(k), 2 if k == "requests_per_s" else 1) for k in cols), "0"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
    )


def plot(stack: dict, hf: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = [int(c) for c, r in stack.items() if "output_tokens_per_s" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    refs = [
        (k, lab, ls)
        for k, lab, ls in (
            ("batch1", "transformers batch 1", "--"),
            ("batch", "transformers padded batch", ":"),
        )
        if "output_tokens_per_s" in hf.get(k, {})
    ]
    ax = axes[0]
    ax.plot(
        conc,
        [stack[str(c)]["output_tokens_per_s"] for c in conc],
        "o-",
        color="C0",
        label="pdserve up: output tok/s",
    )
    for k, lab, ls in refs:
        ax.axhline(hf[k]["output_tokens_per_s"], color="C1", ls=ls, label=lab)
    ax2 = ax.twinx()
    ax2.plot(
        conc,
        [stack[str(c)]["requests_per_s"] for c in conc],
        "s-",
        color="C2",
        alpha=0.6,
        label="pdserve up: requests/s",
    )
    ax2.set_ylabel("requests/s", color="C2")
    ax2.set_ylim(0, None)
    ax.set(title="Throughput vs concurrency", ylabel="output tokens/s", ylim=(0, None))
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    for ax, metric, name in (
        (axes[1], "ttft", "Time to first token"),
        (axes[2], "itl", "Inter-token latency"),
    ):
        for q, mk in (("p50", "o-"), ("p99", "^--")):
            ax.plot(
                conc,
                [stack[str(c)][f"{metric}_{q}_ms"] for c in conc],
                mk,
                color="C0" if q == "p50" else "C3",
                label=f"pdserve up {q}",
            )
        for k, lab, ls in refs:
            for q, col in (("p50", "C1"), ("p99", "C4")):
                if k == "batch" and metric == "ttft" and q == "p99":
                    continue  # one sample: p50 = p99
                ax.axhline(hf[k][f"{metric}_{q}_ms"], color=col, ls=ls, lw=1, label=f"{lab} {q}")
        ax.set(title=name, ylabel="ms", yscale="log")
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--concurrency",
        type=ints,
        default=[1, 8, 32],
        help="concurrent client requests, comma-separated (default 1,8,32)",
    )
    p.add_argument(
        "--prompts",
        type=int,
        default=32,
        help="number of prompts; every concurrency level sends each once (default 32)",
    )
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt in tokens (default 16)")
    p.add_argument("--max-len", type=int, default=512, help="longest prompt in tokens (default 512)")
    p.add_argument(
        "--max-tokens", type=int, default=64, help="output tokens per request, EOS ignored (default 64)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths and token ids (default 0)")
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed requests sent to the stack before measuring (default 4)",
    )
    p.add_argument("--prefill-cp", type=int, default=2, help="pdserve up --prefill-cp (default 2)")
    p.add_argument("--decode-tp", type=int, default=2, help="pdserve up --decode-tp (default 2)")
    p.add_argument("--decode-dcp", type=int, default=2, help="pdserve up --decode-dcp (default 2)")
    p.add_argument(
        "--dcp-index", default="copy", choices=("copy", "split"), help="pdserve up --dcp-index (default copy)"
    )
    p.add_argument(
        "--transfer", default="tcp", choices=("tcp", "nixl"), help="pdserve up --transfer (default tcp)"
    )
    p.add_argument("--port", type=int, default=0, help="router port (default 0: a free one)")
    p.add_argument("--skip-transformers", action="store_true", help="measure only the stack")
    p.add_argument("--skip-stack", action="store_true", help="measure only transformers")
    add_model_and_out(p, "serve")
    p.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds allowed per request and per transformers subprocess (default 600)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=300,
        help="seconds the stack gets to print its ready line (default 300)",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, even without pip install -e
    model_dir = resolve_model(a.model)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(a.prompts, a.min_len, a.max_len, vocab, a.seed)
    t_start = time.perf_counter()
    machine = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "httpx": version("httpx"),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "loadavg_at_start": os.getloadavg(),
    }

    stack_res, stack_info = {}, {}
    if not a.skip_stack:
        log_dir = tempfile.mkdtemp(prefix="pdserve-bench-logs-")
        sp = StackProcess(a, model_dir, log_dir)
        print(f"  starting: {' '.join(sp.cmd[1:])}", file=sys.stderr, flush=True)
        try:
            startup = sp.start(a.ready_timeout)
            print(f"  ready at {sp.url} after {startup:.1f} s", file=sys.stderr, flush=True)
            stack_res = asyncio.run(run_stack(sp.url, sp.model, prompts, a))
        finally:
            rc = sp.stop()
        stack_info = {
            "command": " ".join(["pdserve", *sp.cmd[3:]]),
            "startup_s": startup,
            "stop_returncode": rc,
            "log_dir": log_dir,
            "launcher_output": sp.lines,
        }
        print(f"  stack stopped (rc {rc}); logs in {log_dir}", file=sys.stderr, flush=True)

    hf_res = {}
    if not a.skip_transformers:
        hf_res["batch1"] = run_hf("batch1", prompts, a, model_dir)
        hf_res["batch"] = run_hf("batch", prompts, a, model_dir)

    # greedy agreement: the stack's outputs across concurrency levels and against transformers batch 1
    ids = {f"stack_c{c}": r.pop("token_ids") for c, r in stack_res.items()}
    ids.update({f"hf_{k}": r.pop("token_ids") for k, r in hf_res.items() if "token_ids" in r})
    ref = "hf_batch1" if "hf_batch1" in ids else next(iter(ids), None)
    agree = {f"{k}_vs_{ref}": agreement(v, ids[ref]) for k, v in ids.items() if k != ref}

    rat = ratios(stack_res, hf_res, a.concurrency) if stack_res else {}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "worker"}
    doc = {
        "machine": machine,
        "config": dict(
            config,
            model=model_dir,
            prompt_lengths=[len(p) for p in prompts],
            hf_torch_threads=2,
            stack_torch_threads_per_rank=1,
            mem_cap_bytes=MEM_CAP,
        ),
        "stack": stack_info,
        "measurements": {"stack": stack_res, "transformers": hf_res},
        "greedy_agreement": agree,
        "ratios": rat,
        "total_s": time.perf_counter() - t_start,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve.json").write_text(json.dumps(doc, indent=1) + "\n")
    title = (
        f"pdserve up --prefill-cp {a.prefill_cp} --decode-tp {a.decode_tp} --decode-dcp {a.decode_dcp} "
        f"(small model, {a.prompts} prompts of {a.min_len}-{a.max_len} tokens, {a.max_tokens} output tokens each) "
        f"vs transformers generate"
    )
    if stack_res:
        plot(stack_res, hf_res, a.out / "serve.png", title)
    print(table(stack_res, hf_res))
    for name, r in rat.items():
        print(f"{name}: {r:.2f}")
    for name, r in agree.items():
        diff = ", ".join(
            f"prompt {d['prompt']} ({len(prompts[d['prompt']])} tokens) from token {d['first_difference_at']}"
            for d in r["differing"]
        )
        print(
            f"greedy agreement {name}: {r['identical']}/{r['compared']} identical"
            + (f"; differ: {diff}" if diff else "")
        )
    print(
        f"total {doc['total_s']:.0f} s; wrote {a.out / 'serve.json'}"
        + (f" and {a.out / 'serve.png'}" if stack_res else "")
    )


if __name__ == "__main__":
    main()
