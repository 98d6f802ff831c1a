"""bench/serve.py's baseline: transformers' generate on the same prompts, in a fresh subprocess per
batch size (`python bench/serve_hf.py SPEC.json` prints one BENCH_RESULT line), with 2 threads and an
address-space cap so an out-of-memory batch is a result, not a dead machine."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serve_stack import summary  # bench/ is on sys.path when a script runs

MEM_CAP = 14 * 2**30
MARK = "BENCH_RESULT "


def hf_worker(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class StepTimes(BaseStreamer):
        """generate() calls put() with the prompt first, then once per step with the new tokens."""

        def __init__(self):
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value):
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self):
            pass

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    prompts, out_lens, batch = spec["prompts"], spec["output_lens"], spec["batch"]

    def run(rows: list[list[int]], n: int) -> tuple[float, list[float], list[list[int]]]:
        width = max(map(len, rows))  # left padding: every row ends at the same position
        ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        streamer = StepTimes()
        gen = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, streamer=streamer, **gen)
        return t0, streamer.times, out[:, width:].tolist()

    run([prompts[0][:16]], 2)  # warm-up
    # static batching, as transformers serves: the prompts in groups of `batch`, in order; a group
    # runs until its longest output is done, and only the tokens each request asked for count
    ttft, itl, e2e, tpot, ids_out, tokens = [], [], [], [], [], 0
    wall0 = time.perf_counter()
    for g in range(0, len(prompts), batch):
        rows, lens = prompts[g : g + batch], out_lens[g : g + batch]
        t0, times, out = run(rows, max(lens))
        for n, o in zip(lens, out):
            ttft.append(times[0] - t0)
            itl += [b - a for a, b in zip(times[: n - 1], times[1:n])]
            e2e.append(times[n - 1] - t0)
            tpot.append((times[n - 1] - times[0]) / (n - 1) if n > 1 else 0.0)
            ids_out.append(o[:n])
            tokens += n
    res = summary(len(prompts), tokens, time.perf_counter() - wall0, ttft, itl, e2e)
    res["batch"] = batch
    res["tpot_s"] = tpot
    res["ttft_s"] = ttft
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    res["process_cpu_s"] = cpu.ru_utime + cpu.ru_stime  # over wall_s x 2 threads: how much CPU it got
    return {**res, "token_ids": ids_out}


def worker(spec: dict) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEM_CAP, MEM_CAP))
    import torch

    torch.set_num_threads(2)
    try:
        result = hf_worker(spec)
    except MemoryError:
        result = {"error": "out of memory"}
    print(MARK + json.dumps(result), flush=True)


def run_hf(
    batch: int, prompts: list[list[int]], output_lens: list[int], a: argparse.Namespace, model_dir: str
) -> dict:
    """transformers' generate over the prompts in static batches of `batch` (a fresh subprocess)."""
    spec = json.dumps({"batch": batch, "prompts": prompts, "output_lens": output_lens, "model": model_dir})
    print(f"  transformers batch {batch} ...", file=sys.stderr, flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:  # too long for argv
        f.write(spec)
    try:
        p = subprocess.run(
            [sys.executable, __file__, f.name], capture_output=True, text=True, timeout=a.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    finally:
        os.unlink(f.name)
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = p.stderr.strip().splitlines()[-3:]
    print(f"  transformers batch {batch} failed (rc {p.returncode}): {' | '.join(tail)}", file=sys.stderr)
    return {
        "error": "out of memory" if p.returncode == -9 else f"exit {p.returncode}: {tail[-1] if tail else ''}"
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, even without pip install -e
    worker(json.loads(Path(sys.argv[1]).read_text()))
