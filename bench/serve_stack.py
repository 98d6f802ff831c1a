"""The stack side of bench/serve.py: `pdserve up` as a subprocess, the streaming client that loads it
at a given concurrency, and the prompt and latency statistics both sides of the bench share."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import free_port  # bench/ is on sys.path when a script runs


# ---------------------------------------------------------------- prompts and statistics
def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of random token ids, lengths geometrically spread over [lo, hi], shuffled (deterministic)."""
    rng = random.Random(seed)
    lengths = [round(lo * (hi / lo) ** (i / max(n - 1, 1))) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(1, vocab) for _ in range(k)] for k in lengths]


def pct(xs: list[float], q: float) -> float | None:
    """Percentile q (0-100) with linear interpolation, like numpy's default."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(
    n_requests: int, tokens: int, wall: float, ttft: list[float], itl: list[float], e2e: list[float]
) -> dict:
    return {
        "requests": n_requests,
        "output_tokens": tokens,
        "wall_s": wall,
        "requests_per_s": n_requests / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50),
        "ttft_p99_ms": 1000 * pct(ttft, 99),
        "itl_p50_ms": 1000 * pct(itl, 50) if itl else None,
        "itl_p99_ms": 1000 * pct(itl, 99) if itl else None,
        "itl_mean_ms": 1000 * sum(itl) / len(itl) if itl else None,
        "e2e_p50_ms": 1000 * pct(e2e, 50),
        "e2e_p99_ms": 1000 * pct(e2e, 99),
    }


# ---------------------------------------------------------------- transformers worker (subprocess)


# ---------------------------------------------------------------- the stack


class StackProcess:
    """`pdserve up` as a subprocess: started, waited for ("ready: URL/v1"), stopped with SIGTERM."""

    def __init__(self, a: argparse.Namespace, model_dir: str, log_dir: str):
        self.port = a.port or free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            model_dir,
            "--prefill-cp",
            str(a.prefill_cp),
            "--decode-tp",
            str(a.decode_tp),
            "--decode-dcp",
            str(a.decode_dcp),
            "--dcp-index",
            a.dcp_index,
            "--transfer",
            a.transfer,
            "--port",
            str(self.port),
            "--log-dir",
            log_dir,
            "--ready-timeout",
            str(a.ready_timeout),
        ]
        self.lines: list[str] = []
        self.url: str | None = None
        self.model: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            start_new_session=True,
        )
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("ready: "):  # "ready: http://127.0.0.1:P/v1  (model 'NAME'; ...)"
                    self.url = line.split()[1].removesuffix("/v1")
                    self.model = line.split("'")[1]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n  " + "\n  ".join(self.lines[-20:]))
        return time.perf_counter() - t0

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:  # the launcher gives its children 20 s each; should not happen
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    times, ids, chunks, multi = [], [], 0, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": f"stream error: {ev['error'].get('message')}"}
            new = [i for c in ev.get("choices", []) for i in c.get("token_ids") or []]
            if new:
                now = time.perf_counter()
                if times:  # k tokens in one chunk: k gaps of gap / k
                    gap = (now - times[-1]) / len(new)
                    times += [times[-1] + gap * (j + 1) for j in range(len(new))]
                else:  # the first chunk: its tokens all arrive now
                    times += [now] * len(new)
                ids += new
                chunks += 1
                multi += len(new) > 1
    end = time.perf_counter()
    if not times:
        return {"error": "no token streamed"}
    return {
        "ttft": times[0] - t0,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "e2e": end - t0,
        "token_ids": ids,
        "chunks": chunks,
        "multi_token_chunks": multi,
        "prompt_tokens": len(prompt),
    }


async def run_level(
    url: str, model: str, prompts: list[list[int]], concurrency: int, a: argparse.Namespace
) -> dict:
    import httpx

    queue = list(enumerate(prompts))
    results: list[dict | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout, connect=30), limits=limits) as client:

        async def task():
            while queue:
                i, p = queue.pop(0)
                try:
                    results[i] = await one_request(client, url, model, p, a.max_tokens)
                except Exception as e:  # noqa: BLE001 (timeouts, resets: recorded, the run goes on)
                    results[i] = {"error": f"{type(e).__name__}: {e}"}

        t0 = time.perf_counter()
        await asyncio.gather(*(task() for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    res = (
        summary(
            len(ok),
            sum(len(r["token_ids"]) for r in ok),
            wall,
            [r["ttft"] for r in ok],
            [g for r in ok for g in r["itl"]],
            [r["e2e"] for r in ok],
        )
        if ok
        else {"wall_s": wall}
    )
    res["concurrency"] = concurrency
    res["errors"] = [f"prompt {i}: {r['error']}" for i, r in enumerate(results) if "error" in r]
    res["multi_token_chunks"] = sum(r["multi_token_chunks"] for r in ok)
    res["short_outputs"] = sum(len(r["token_ids"]) != a.max_tokens for r in ok)
    res["per_request"] = [
        {
            "prompt_tokens": len(p),
            **(
                {"error": r["error"]}
                if "error" in r
                else {
                    "ttft_ms": 1000 * r["ttft"],
                    "e2e_ms": 1000 * r["e2e"],
                    "output_tokens": len(r["token_ids"]),
                    "chunks": r["chunks"],
                }
            ),
        }
        for p, r in zip(prompts, results)
    ]
    res["token_ids"] = [r.get("token_ids") for r in results]
    return res


async def run_stack(url: str, model: str, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    if a.warmup:
        print(f"  stack warm-up ({a.warmup} requests) ...", file=sys.stderr, flush=True)
        warm = [prompts[i % len(prompts)] for i in range(a.warmup)]
        w = await run_level(url, model, warm, len(warm), a)
        if w["errors"]:
            raise RuntimeError(f"warm-up failed: {w['errors'][:3]}")
    out = {}
    for c in a.concurrency:
        print(f"  stack concurrency {c} ...", file=sys.stderr, flush=True)
        load0 = os.getloadavg()[0]
        out[str(c)] = await run_level(url, model, prompts, c, a)
        out[str(c)]["loadavg_1min_before_after"] = [load0, os.getloadavg()[0]]
    return out
