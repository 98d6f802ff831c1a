"""Serving benchmark: the whole stack (`pdserve up`) under SGLang's load client vs transformers.

The load comes from a client nobody on this project wrote: SGLang's `sglang.bench_serving`
(`--backend vllm`: OpenAI `/v1/completions`, streaming, `ignore_eos`), in a virtualenv of its own
(bench/load_client.py builds it once). Its numbers are the ones reported: requests/s, output
tokens/s, TTFT and ITL p50/p99, and goodput under an SLO (TTFT <= --slo-ttft-ms and TPOT, the mean
inter-token time of a request, <= --slo-itl-ms; SGLang's goodput has no per-gap ITL criterion).

Workloads (both from SGLang's dataset code, seeded, nothing downloaded):
- random: `random-ids`, input lengths uniform in [input-len x ratio, input-len], output lengths in
  [output-len x ratio, output-len] (one ratio for both in this client), at every --concurrency
  (closed loop) and at every --rates request rate (open loop, Poisson, capped at the highest
  concurrency);
- shared prefix: `generated-shared-prefix`, --gsp-groups groups of --gsp-prompts prompts that share a
  --gsp-system-len-token system prompt, at concurrency --gsp-concurrency.

Baseline, like with like: transformers' `generate` on exactly the random set's prompts (the ids our
tokenizer gives for the text the client sends), in static batches of each --hf-batches size (a group
runs until its longest output is done; only requested tokens count), with the same repeats as the
stack and an idle wait before each side. The headline is the ratio of medians: the stack's output
tokens/s at --headline-concurrency over transformers' best batch.

Run:  .venv/bin/python bench/serve.py [--quick]     (bench/results/serve.json and serve.png)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import load_client  # bench/ is on sys.path when a script runs
from common import add_model_and_out, idle_side, machine_info, resolve_model, spread
from serve_hf import MEM_CAP, run_hf
from serve_report import median, plot, prefill_ceiling, summary_rows, table
from serve_stack import StackProcess

SLO_KEYS = ("output_throughput", "request_throughput", "request_goodput", "median_ttft_ms")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def level_row(r: dict) -> dict:
    """The numbers we keep of one bench_serving result (its own field names)."""
    keep = (
        "completed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "median_tpot_ms",
        "median_e2e_latency_ms",
        "request_goodput",
        "slo_attainment",
        "concurrency",
        "command",
    )
    row = {k: r.get(k) for k in keep}
    row["failed"] = sum(1 for e in r.get("errors", []) if e)
    row["errors"] = [e for e in r.get("errors", []) if e][:5]
    return row


def hf_row(r: dict, slo_ttft_ms: float, slo_itl_ms: float) -> dict:
    """transformers' result in the load client's names, goodput by the same definition."""
    if "error" in r:
        return {"error": r["error"]}
    good = sum(
        1 for t, p in zip(r["ttft_s"], r["tpot_s"]) if 1000 * t <= slo_ttft_ms and 1000 * p <= slo_itl_ms
    )
    return {
        "completed": r["requests"],
        "duration": r["wall_s"],
        "request_throughput": r["requests_per_s"],
        "output_throughput": r["output_tokens_per_s"],
        "total_output_tokens": r["output_tokens"],
        "median_ttft_ms": r["ttft_p50_ms"],
        "p99_ttft_ms": r["ttft_p99_ms"],
        "median_itl_ms": r["itl_p50_ms"],
        "p99_itl_ms": r["itl_p99_ms"],
        "median_e2e_latency_ms": r["e2e_p50_ms"],
        "request_goodput": good / r["wall_s"],
        "slo_attainment": good / r["requests"],
        "batch": r["batch"],
        "process_cpu_s": r.get("process_cpu_s"),
    }


def repeated(fn, repeats: int, idle_wait: float, label: str) -> dict:
    """`repeats` runs of fn(), each after an idle wait; the runs and min/median/max of the key numbers."""
    runs, idle = [], []
    for i in range(repeats):
        idle.append(idle_side(idle_wait, f"{label} run {i + 1}/{repeats}"))
        runs.append(fn())
    ok = [r for r in runs if "error" not in r]
    return {
        "runs": runs,
        "idle_before": idle,
        **{k: spread([r.get(k) for r in ok]) for k in SLO_KEYS},
    }


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 prompts, short lengths, c=1,8")
    p.add_argument("--concurrency", type=ints, default=[1, 8, 32, 64], help="closed-loop levels (1,8,32,64)")
    p.add_argument("--rates", type=floats, default=[1.0, 2.0, 4.0], help="request rates per s (1,2,4)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per level (default 64)")
    p.add_argument("--input-len", type=int, default=4096, help="longest input in tokens (default 4096)")
    p.add_argument("--output-len", type=int, default=256, help="longest output in tokens (default 256)")
    p.add_argument(
        "--range-ratio", type=float, default=0.0625, help="shortest / longest length (default 1/16)"
    )
    p.add_argument("--gsp-groups", type=int, default=4, help="shared-prefix groups (default 4)")
    p.add_argument("--gsp-prompts", type=int, default=8, help="prompts per group (default 8)")
    p.add_argument("--gsp-system-len", type=int, default=2048, help="shared system prompt tokens (2048)")
    p.add_argument("--gsp-question-len", type=int, default=128, help="question tokens (default 128)")
    p.add_argument("--gsp-output-len", type=int, default=64, help="output tokens (default 64)")
    p.add_argument("--gsp-concurrency", type=int, default=8, help="shared-prefix concurrency (default 8)")
    p.add_argument("--hf-batches", type=ints, default=[1, 8, 32], help="transformers batch sizes (1,8,32)")
    p.add_argument("--headline-concurrency", type=int, default=32, help="the headline's level (default 32)")
    p.add_argument("--repeats", type=int, default=1, help="runs per level, both sides alike (default 1)")
    p.add_argument("--idle-wait", type=float, default=120, help="max s to wait for idle before each side")
    p.add_argument("--slo-ttft-ms", type=float, default=2000, help="goodput SLO on TTFT (default 2000)")
    p.add_argument("--slo-itl-ms", type=float, default=100, help="goodput SLO on TPOT (default 100)")
    p.add_argument("--seed", type=int, default=0, help="the load client's seed (default 0)")
    p.add_argument(
        "--prefill-instances",
        type=int,
        default=2,
        help="pdserve up --prefill-instances (default 2: two 1-rank instances; see --prefill-cp)",
    )
    p.add_argument(
        "--prefill-cp",
        type=int,
        default=1,
        help="pdserve up --prefill-cp (default 1: on a 2-core host beside a decode rank, a C_p = 2 pair's "
        "per-layer all-gathers wait whenever the decode rank holds one of its cores; two 1-rank instances "
        "never wait on each other. bench/prefill_cp.py measures what CP is for: one long prompt's TTFT)",
    )
    p.add_argument(
        "--policy",
        default="least_load",
        choices=("round_robin", "least_load", "cache_aware"),
        help="pdserve up --policy (default least_load: the prompts' lengths vary)",
    )
    p.add_argument(
        "--decode-tp",
        type=int,
        default=1,
        help="pdserve up --decode-tp (default 1: on a 2-core host the ranks of a larger decode group "
        "time-share the cores with the prefill ranks, and each step's collectives wait for a time slice)",
    )
    p.add_argument("--decode-dcp", type=int, default=1, help="pdserve up --decode-dcp (default 1)")
    p.add_argument("--dcp-index", default="copy", choices=("copy", "split"), help="--dcp-index (copy)")
    p.add_argument("--transfer", default="tcp", choices=("tcp", "nixl"), help="--transfer (default tcp)")
    p.add_argument("--port", type=int, default=0, help="router port (default 0: a free one)")
    p.add_argument("--skip-transformers", action="store_true", help="measure only the stack")
    p.add_argument("--skip-stack", action="store_true", help="measure only transformers")
    add_model_and_out(p, "serve")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per load run / transformers run")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds for the stack to be ready")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # smaller defaults; explicit flags still win
        p.set_defaults(
            concurrency=[1, 8], rates=[4.0], prompts=16, input_len=1024, output_len=64, range_ratio=0.125
        )
        p.set_defaults(gsp_groups=2, gsp_prompts=4, gsp_system_len=512, gsp_output_len=16)
        p.set_defaults(hf_batches=[1, 8], headline_concurrency=8)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, even without pip install -e
    from pdserve.model.tokenizer import Tokenizer

    model_dir = resolve_model(a.model)
    t_start = time.perf_counter()
    doc = {"machine": machine_info(("torch", "transformers", "httpx"))}
    load_client.ensure(log)
    doc["machine"]["load_client"] = f"sglang {load_client.SGLANG} (sglang.bench_serving --backend vllm)"
    rnd = {
        "name": "random-ids",
        "random_input_len": a.input_len,
        "random_output_len": a.output_len,
        "random_range_ratio": a.range_ratio,
    }
    gsp = {
        "name": "generated-shared-prefix",
        "gsp_num_groups": a.gsp_groups,
        "gsp_prompts_per_group": a.gsp_prompts,
        "gsp_system_prompt_len": a.gsp_system_len,
        "gsp_question_len": a.gsp_question_len,
        "gsp_output_len": a.gsp_output_len,
    }
    goodput = ["--goodput", f"ttft:{a.slo_ttft_ms:g}", f"tpot:{a.slo_itl_ms:g}"]
    name = Path(model_dir).name
    rows = load_client.dataset("http://127.0.0.1:1", name, model_dir, rnd, a.prompts, a.seed)
    tok = Tokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(r["prompt"]) for r in rows]
    out_lens = [r["output_len"] for r in rows]

    stack: dict = {"random": {}, "rates": {}, "shared_prefix": {}}
    if not a.skip_stack:
        log_dir = tempfile.mkdtemp(prefix="pdserve-bench-logs-")
        sp = StackProcess(a, model_dir, log_dir)
        log(f"  starting: {' '.join(sp.cmd[1:])}")
        try:
            startup = sp.start(a.ready_timeout)
            log(f"  ready at {sp.url} after {startup:.1f} s")

            def level(spec, n, conc, rate=None):
                def run():  # every run starts with empty prefix caches, as transformers' runs do
                    flushed = sp.flush_caches()
                    row = level_row(
                        load_client.run(
                            sp.url, sp.model, model_dir, spec, n, a.seed, conc, rate, goodput, a.timeout
                        )
                    )
                    return {**row, "flushed_tokens_before": flushed}

                return run

            level(rnd, min(4, a.prompts), 4)()  # warm-up, untimed
            for c in a.concurrency:
                stack["random"][f"c{c}"] = repeated(
                    level(rnd, a.prompts, c), a.repeats, a.idle_wait, f"c={c}"
                )
            for r in a.rates:
                stack["rates"][f"rate{r:g}"] = repeated(
                    level(rnd, a.prompts, max(a.concurrency), r), a.repeats, a.idle_wait, f"rate={r:g}/s"
                )
            n_gsp = a.gsp_groups * a.gsp_prompts
            stack["shared_prefix"][f"c{a.gsp_concurrency}"] = repeated(
                level(gsp, n_gsp, a.gsp_concurrency), a.repeats, a.idle_wait, "shared prefix"
            )
        finally:
            rc = sp.stop()
        stack["process"] = {"command": " ".join(["pdserve", *sp.cmd[3:]]), "startup_s": startup, "rc": rc}

    hf: dict = {}
    if not a.skip_transformers:
        for b in a.hf_batches:
            hf[f"batch{b}"] = repeated(
                lambda b=b: hf_row(run_hf(b, prompts, out_lens, a, model_dir), a.slo_ttft_ms, a.slo_itl_ms),
                a.repeats,
                a.idle_wait,
                f"transformers batch {b}",
            )

    head = median(stack["random"].get(f"c{a.headline_concurrency}", {}), "output_throughput")
    best = max(
        ((median(v, "output_throughput"), k) for k, v in hf.items() if median(v, "output_throughput")),
        default=(None, None),
    )
    doc.update(
        title=(
            f"pdserve up --prefill-instances {a.prefill_instances} --prefill-cp {a.prefill_cp} "
            f"--decode-tp {a.decode_tp} --decode-dcp {a.decode_dcp} "
            f"under sglang.bench_serving ({a.prompts} random prompts, input <= {a.input_len}, "
            f"output <= {a.output_len}) vs transformers generate in static batches"
        ),
        config={
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "model": model_dir,
            "input_tokens_ours": [len(p) for p in prompts],
            "output_lens": out_lens,
            "hf_torch_threads": 2,
            "stack_torch_threads_per_rank": 1,
            "mem_cap_bytes": MEM_CAP,
        },
        stack=stack,
        transformers=hf,
        headline={
            "stack_output_tok_s": head,
            "hf_best_batch": best[1],
            "hf_best_output_tok_s": best[0],
            "stack_over_hf_best_output_tok_s": head / best[0] if head and best[0] else None,
            "prefill_ceiling": prefill_ceiling(
                stack["random"], f"c{a.headline_concurrency}", a.prefill_instances, a.prefill_cp
            ),
            "target": 5.0,
            "failed_requests": sum(
                run.get("failed", 0)
                for part in ("random", "rates", "shared_prefix")
                for lv in stack[part].values()
                for run in lv["runs"]
            ),
        },
        total_s=time.perf_counter() - t_start,
    )
    doc["summary"] = summary_rows(doc, a)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve.json").write_text(json.dumps(doc, indent=1) + "\n")
    if stack["random"] and hf:
        plot(doc, a.out / "serve.png")
    rows = {f"{part} {k}": v for part in ("random", "rates", "shared_prefix") for k, v in stack[part].items()}
    print(table(rows, hf))  # keys prefixed: the random set's c8 and the shared-prefix set's c8 are two rows
    h = doc["headline"]
    if h["stack_over_hf_best_output_tok_s"]:
        print(
            f"headline: stack c={a.headline_concurrency} {h['stack_output_tok_s']:.1f} out tok/s over "
            f"transformers {h['hf_best_batch']} {h['hf_best_output_tok_s']:.1f} = "
            f"{h['stack_over_hf_best_output_tok_s']:.2f}x (target >= 5x); failed requests {h['failed_requests']}"
        )
    if h.get("prefill_ceiling"):
        c = h["prefill_ceiling"]
        print(
            f"prefill-bound ceiling at c={a.headline_concurrency}: {c['output_tok_s']:.1f} out tok/s "
            f"(prefill {c['prefill_tok_s_c1']:.0f} tok/s at c=1 x {c['instances_at_once']} instance(s), decode free)"
            + (
                f" = {c['output_tok_s'] / h['hf_best_output_tok_s']:.2f}x transformers"
                if h["hf_best_output_tok_s"]
                else ""
            )
        )
    print(f"total {doc['total_s']:.0f} s; wrote {a.out / 'serve.json'}")


if __name__ == "__main__":
    main()
