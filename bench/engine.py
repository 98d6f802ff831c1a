"""Engine benchmark: pdserve's single-rank engine vs Hugging Face transformers, same checkpoint.

Claim measured: on the built-in `small` glm_moe_dsa model (DSA, index_topk 256) our engine
  1. prefills faster than transformers and its prefill memory grows linearly with the prompt
     (peak RSS growth 16k / 4k is about 4x; a [S, S] score tensor would make it 16x), and
  2. decodes faster (tokens/s at batch 1 and 8, prefill excluded).
Every measurement runs in a fresh subprocess (this script with --worker) with
torch.set_num_threads(2), a 14 GiB address-space cap and a timeout, so a transformers run that
runs out of memory or time is recorded as {"error": ...} instead of crashing the benchmark.
Peak memory is the peak RSS (ru_maxrss, after resetting it via /proc/self/clear_refs) minus the
RSS after the weights are loaded and warmed up; for our engine it includes the KV pool.
Decode: requests are prefilled, WARMUP_STEPS untimed steps run, then --decode-steps steps are timed
(ours: engine.step(); transformers: a greedy forward loop with past_key_values).
Roofline of decode batch 1 (bench/roofline.py `decode_roofline`): the bytes a step must read (active
weights, LM head, selected latent entries, every index key) over memcpy's bandwidth (read + write)
and a pure read stream's, each measured after every window of BW_WINDOW timed steps in the same
worker, plus the torch calls one step makes and the cost of an empty call; also on the `medium`
preset (--weight-bound-size), whose step is bound by its bytes rather than its calls.

Run:  .venv/bin/python bench/engine.py          (writes bench/results/engine.json and engine.png)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (  # bench/ is on sys.path when a script runs
    add_model_and_out,
    idle_side,
    machine_info,
    preset_model,
    resolve_model,
)
from engine_report import decode_bound_line, plot, ratios, summary_rows, table
from roofline import call_us, decode_roofline, memcpy_gbps, read_gbps, torch_calls

MEM_CAP = 14 * 2**30
WARMUP_STEPS = 2
BW_WINDOW = 8  # decode steps per bandwidth sample (see ours_decode)
BW_BYTES = 128 << 20  # each sample's buffer: well past the last-level cache
REPEATS = 2  # prefill runs per measurement (set by --repeats)
MARK = "BENCH_RESULT "
ENGINES = ("ours", "transformers")


# ---------------------------------------------------------------- worker side (one measurement)
def rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM and so ru_maxrss
        f.write("5")


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def peak_growth_mb(base_kb: int) -> float:
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kb) / 1024


def ours_engine(model, kv_tokens: int):
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(model, max_kv_tokens=kv_tokens, prefill_chunk=4096)


def ours_prefill(model_dir: str, length: int) -> dict:
    import torch

    from pdserve.model.weights import load_model
    from pdserve.request import SamplingParams

    model = load_model(model_dir, torch.float32)
    ours_engine(model, 512).generate(
        [prompt_ids(300, 1, model.config.vocab_size)], SamplingParams(max_tokens=2)
    )
    ids = prompt_ids(length, length, model.config.vocab_size)
    reset_peak()
    base = rss_kb()
    engine = ours_engine(model, length + 16)  # the KV pool counts as prefill memory
    return timed_prefill(
        lambda: engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True)), length, base
    )


def timed_prefill(fn, length: int, base_kb: int) -> dict:
    """--repeats runs, the same number for both engines; the median counts (min and max recorded)."""
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    return {
        "seconds": dt,
        "min_seconds": min(times),
        "max_seconds": max(times),
        "all_seconds": times,
        "tokens_per_s": length / dt,
        "peak_mb": peak_growth_mb(base_kb),
        "base_rss_mb": base_kb / 1024,
    }


def hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_prefill(model_dir: str, length: int) -> dict:
    import torch

    model = hf_model(model_dir)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        model(torch.tensor([prompt_ids(300, 1, vocab)])).logits[:, -1]
        ids = torch.tensor([prompt_ids(length, length, vocab)])
        reset_peak()
        return timed_prefill(lambda: model(ids).logits[:, -1], length, rss_kb())


def ours_decode(model_dir: str, batch: int, context: int, steps: int) -> dict:
    import torch

    from pdserve.model.weights import load_model
    from pdserve.request import SamplingParams

    model = load_model(model_dir, torch.float32)
    engine = ours_engine(model, batch * (context + steps + WARMUP_STEPS + 16))
    params = SamplingParams(max_tokens=steps + WARMUP_STEPS + 2, ignore_eos=True)  # +1: the counted step
    reqs = [
        engine.add_request(prompt_ids(context, 100 + i, model.config.vocab_size), params)
        for i in range(batch)
    ]
    while len(engine.scheduler.running) < batch or any(len(r.output_ids) < 1 for r in reqs):
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    step_s, produced, windows = [], 0, []
    for start in range(0, steps, BW_WINDOW):
        window = []
        for _ in range(min(BW_WINDOW, steps - start)):
            t0 = time.perf_counter()
            produced += len(engine.step())
            window.append(time.perf_counter() - t0)
        step_s += window
        # this VM's memory rate shifts within minutes (memcpy 20-40 GB/s): each window of steps is
        # paired with the bandwidths measured right after it, in the same process
        windows.append(
            {
                "ms_per_step": 1000 * statistics.median(window),
                "memcpy_read_GBps": memcpy_gbps(2, BW_BYTES, 3),
                "read_GBps": read_gbps(2, BW_BYTES, 3),
            }
        )
    assert produced == batch * steps, f"expected {batch * steps} tokens, got {produced}"
    from pdserve.native import ops as native

    return dict(
        decode_result(step_s, batch),
        native=native.status(),  # what the step's few-row products ran on
        torch_calls_per_step=torch_calls(engine.step),
        call_us=call_us(),
        bandwidth_windows=windows,
    )


def decode_result(step_s: list[float], batch: int) -> dict:
    """tokens_per_s and ms_per_step come from the median step (the mean is recorded beside them)."""
    dt, median = sum(step_s), statistics.median(step_s)
    return {
        "seconds": dt,
        "tokens_per_s": batch / median,
        "ms_per_step": 1000 * median,
        "ms_per_step_min_max": [1000 * min(step_s), 1000 * max(step_s)],
        "ms_per_step_mean": 1000 * dt / len(step_s),
        "tokens_per_s_from_mean": batch * len(step_s) / dt,
    }


def hf_decode(model_dir: str, batch: int, context: int, steps: int) -> dict:
    import torch

    model = hf_model(model_dir)
    ids = torch.tensor([prompt_ids(context, 100 + i, model.config.vocab_size) for i in range(batch)])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, use_cache=True)

        def step(out, mask):
            tok = out.logits[:, -1].argmax(-1, keepdim=True)  # greedy, EOS ignored
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            return model(tok, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True), mask

        for _ in range(WARMUP_STEPS):
            out, mask = step(out, mask)
        step_s = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out, mask = step(out, mask)
            step_s.append(time.perf_counter() - t0)
    return decode_result(step_s, batch)


TASKS = {
    ("ours", "prefill"): ours_prefill,
    ("transformers", "prefill"): hf_prefill,
    ("ours", "decode"): ours_decode,
    ("transformers", "decode"): hf_decode,
}


def is_oom(text: str) -> bool:
    return any(
        s in text.lower() for s in ("can't allocate", "cannot allocate", "out of memory", "memoryerror")
    )


def worker(spec: dict) -> None:
    global REPEATS
    REPEATS = spec["repeats"]
    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))
    import torch

    torch.set_num_threads(2)
    try:
        result = TASKS[spec["engine"], spec["kind"]](*spec["args"])
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and not is_oom(str(e)):
            raise
        result = {"error": "out of memory"}
    print(MARK + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent side
def run_worker(engine: str, kind: str, args: list, a: argparse.Namespace) -> dict:
    spec = json.dumps({"engine": engine, "kind": kind, "args": args, "repeats": a.repeats})
    label = f"{engine} {kind} {args[1:]}"
    idle = idle_side(a.idle_wait, label)  # the machine is shared: an idle wait before each side
    print(f"  running {label} ...", file=sys.stderr, flush=True)
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--worker", spec], capture_output=True, text=True, timeout=a.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return dict(json.loads(line[len(MARK) :]), idle_before=idle)
    tail = p.stderr.strip().splitlines()[-3:]
    oom = p.returncode == -9 or is_oom(" ".join(tail))
    print(f"  {label} failed (rc {p.returncode}): {' | '.join(tail)}", file=sys.stderr)
    return {"error": "out of memory" if oom else f"exit {p.returncode}: {tail[-1] if tail else ''}"}


def measure(a: argparse.Namespace, model_dir: str) -> dict:
    engines = ENGINES[:1] if a.skip_transformers else ENGINES
    res = {"prefill": {e: {} for e in engines}, "decode": {e: {} for e in engines}}
    for e in engines:
        for n in a.lengths:
            res["prefill"][e][str(n)] = run_worker(e, "prefill", [model_dir, n], a)
        for b in a.decode_batches:
            res["decode"][e][str(b)] = run_worker(
                e, "decode", [model_dir, b, a.decode_context, a.decode_steps], a
            )
    return res


def measure_weight_bound(a: argparse.Namespace) -> dict:
    """Decode batch 1 on a preset whose step reads far more bytes than it makes calls (`medium`:
    ~0.7 GB per step), ours and transformers: where the memory bound, not per-call cost, sets the
    step time, as for real models (GBs of weights per rank)."""
    model_dir = preset_model(a.weight_bound_size)
    args = [model_dir, 1, a.decode_context, a.decode_steps]
    engines = ENGINES[:1] if a.skip_transformers else ENGINES
    res = {e: run_worker(e, "decode", args, a) for e in engines}
    return {
        "size": a.weight_bound_size,
        "model": model_dir,
        **res,
        # none when our run failed (an error is a result): no step to set against the bound
        "roofline": decode_roofline(model_dir, a.decode_context, res["ours"])
        if res["ours"].get("bandwidth_windows")
        else None,
    }


def parse_args(argv=None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--lengths",
        type=ints,
        default=[1024, 4096, 16384],
        help="prefill prompt lengths, comma-separated (default 1024,4096,16384)",
    )
    p.add_argument(
        "--decode-batches",
        type=ints,
        default=[1, 8],
        help="decode batch sizes, comma-separated (default 1,8)",
    )
    p.add_argument(
        "--decode-context",
        type=int,
        default=1024,
        help="prompt tokens per request before decode (default 1024)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=32,
        help="timed decode steps, one token per request each (default 32)",
    )
    p.add_argument(
        "--weight-bound-size",
        default="medium",
        help="also decode at batch 1 on this preset (built once under ~/.cache/pdserve), whose step is "
        "bound by the bytes it reads, not by its calls; '' skips it (default medium)",
    )
    p.add_argument("--skip-transformers", action="store_true", help="measure only our engine")
    add_model_and_out(p, "engine")
    p.add_argument(
        "--timeout", type=float, default=600, help="seconds allowed per measurement subprocess (default 600)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="prefill runs per length, the same for both engines; the median counts (default 3)",
    )
    p.add_argument(
        "--idle-wait",
        type=float,
        default=120,
        help="before each measured side, wait up to this many seconds for an idle machine (default 120)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, even without pip install -e
    if a.worker:
        return worker(json.loads(a.worker))
    model_dir = resolve_model(a.model)
    machine = dict(machine_info(("torch", "transformers")), torch_threads=2)
    res = measure(a, model_dir)
    ours = res["decode"]["ours"].get("1", {})
    if not ours.get("bandwidth_windows"):  # no decode batch 1 run: the bandwidths alone, after an idle wait
        idle_side(a.idle_wait, "memory bandwidth")
        ours = dict(ours, bandwidth_windows=[{"memcpy_read_GBps": memcpy_gbps(2), "read_GBps": read_gbps(2)}])
    roof = decode_roofline(model_dir, a.decode_context, ours)
    weight_bound = measure_weight_bound(a) if a.weight_bound_size else None
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "worker"}
    doc = {
        "machine": machine,
        "config": dict(config, model=model_dir, warmup_steps=WARMUP_STEPS, mem_cap_bytes=MEM_CAP),
        **res,
        "ratios": ratios(res, a),
        "roofline_decode_batch1": roof,
        "weight_bound_decode_batch1": weight_bound,
    }
    doc["summary"] = summary_rows(doc, a)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "engine.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(res, a.out / "engine.png", a.decode_context)
    print(table(res))
    for name, r in doc["ratios"].items():
        print(f"{name}: {r:.2f}" if r else f"{name}: n/a")
    for r in (roof, weight_bound and weight_bound["roofline"]):
        if r and r["fraction_of_bound"]:
            print(decode_bound_line(r, a.decode_context))
    print(f"wrote {a.out / 'engine.json'} and {a.out / 'engine.png'}")


if __name__ == "__main__":
    main()
