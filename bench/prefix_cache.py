"""Prefix caches + the cache_aware router vs no caches + round_robin, on a multi-turn chat workload.

Workload: --conversations conversations of --turns turns each, all sharing one --system-tokens system
prompt. Turn t sends system + (user_1 + assistant_1) + ... + user_t as token ids to the router's
/v1/completions (streaming, temperature 0, ignore_eos, --max-tokens); the assistant's reply is the
returned text, re-tokenized (as a chat client resends text). Conversations run concurrently, at most
--concurrency at once; a conversation's turns run one after the other.

The same workload runs through `pdserve up` twice, with --prefill-instances 2 --decode-instances 2:
  baseline  --prefix-cache off --policy round_robin
  cached    --prefix-cache on  --policy cache_aware
and the script reports, per side: TTFT p50 / p99 (client-side: request sent -> first streamed
chunk), e2e p50, the prefix-cache hit rate (prompt tokens the prefill instances served from their
caches / prompt tokens sent), and KV bytes per request shipped by the hand-offs and kept off the
wire by the decode instances' caches (from the instances' own counters, before vs after). The
headline is TTFT p50 baseline / cached (the claim: >= 3x), and bytes per request cached / baseline
next to 1 - the decode hit share.

Run:  .venv/bin/python bench/prefix_cache.py [--quick]   (bench/results/prefix_cache.json and .png)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import add_model_and_out, machine_info, resolve_model, wait_until_idle
from serve_stack import StackProcess, pct

SIDES = {
    "baseline": ("off", "round_robin"),
    "cached": ("on", "cache_aware"),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_and_out(p, "prefix_cache")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    p.add_argument("--prefill-instances", type=int, default=2)
    p.add_argument("--decode-instances", type=int, default=2)
    p.add_argument("--max-kv-tokens", type=int, default=65536, help="every instance's KV capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-wait", type=float, default=60.0, help="seconds to wait for an idle machine")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="per request")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 x 3 turns, 256-token system prompt")
    a = p.parse_args(argv)
    if a.quick:
        a.conversations, a.turns, a.system_tokens, a.user_tokens, a.max_tokens = 4, 3, 256, 16, 8
        a.concurrency = min(a.concurrency, 4)
    # what StackProcess reads (bench/serve_stack.py)
    a.prefill_cp, a.decode_tp, a.decode_dcp, a.dcp_index, a.transfer, a.port = 1, 1, 1, "copy", "tcp", None
    return a


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stack_urls(lines: list[str]) -> dict[str, str]:
    """{"prefill-0": url, ...} from `pdserve up`'s output."""
    return dict(re.findall(r"^((?:prefill|decode)-\d+): (http://\S+) ", "\n".join(lines), re.M))


TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"  # `pdserve up` takes the stack's internal token from it


def counters(urls: dict[str, str]) -> dict[str, float]:
    """The instances' own cumulative counters, summed per role (their APIs need the internal token)."""
    out = {"prefix_hit_tokens": 0, "transfer_bytes": 0, "transfer_skipped_bytes": 0, "transfers": 0}
    auth = {"Authorization": f"Bearer {os.environ[TOKEN_ENV]}"}
    if not urls:
        raise RuntimeError("no instance URL in `pdserve up`'s output")
    for name, url in urls.items():
        path = "/info" if name.startswith("prefill") else "/capacity"
        r = httpx.get(url + path, headers=auth, timeout=30)
        r.raise_for_status()
        info = r.json()
        if name.startswith("prefill"):
            out["prefix_hit_tokens"] += info.get("prefix_hit_tokens") or 0
        else:
            out["transfer_bytes"] += info.get("transfer_bytes") or 0
            out["transfer_skipped_bytes"] += info.get("transfer_skipped_bytes") or 0
            out["transfers"] += info.get("transfers_completed") or 0
    return out


async def one_turn(
    client: httpx.AsyncClient, url: str, model: str, ids: list[int], a
) -> tuple[float, float, str]:
    """(ttft_s, e2e_s, text) of one streamed completion."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0, ttft, text = time.perf_counter(), None, []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=a.timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"])[:300])
            text.append(chunk["choices"][0].get("text") or "")
    return ttft, time.perf_counter() - t0, "".join(text)


async def workload(url: str, model: str, tok, a) -> dict:
    rng = random.Random(a.seed)
    vocab = tok.vocab_size

    def words(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    system = words(a.system_tokens)
    users = [[words(a.user_tokens) for _ in range(a.turns)] for _ in range(a.conversations)]
    ttft, e2e, prompt_tokens = [[] for _ in range(a.turns)], [], 0
    gate = asyncio.Semaphore(a.concurrency)

    async def conversation(c: int, client: httpx.AsyncClient):
        nonlocal prompt_tokens
        history = list(system)
        async with gate:
            for t in range(a.turns):
                ids = history + users[c][t]
                first, total, text = await one_turn(client, url, model, ids, a)
                ttft[t].append(first)
                e2e.append(total)
                prompt_tokens += len(ids)
                history = ids + tok.encode(text)

    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, client) for c in range(a.conversations)))
        wall = time.perf_counter() - t0
    flat = [x for per_turn in ttft for x in per_turn]
    return {
        "requests": len(flat),
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "ttft_p50_ms": 1000 * pct(flat, 50),
        "ttft_p99_ms": 1000 * pct(flat, 99),
        "ttft_p50_ms_by_turn": [1000 * pct(x, 50) for x in ttft],
        "e2e_p50_ms": 1000 * pct(e2e, 50),
    }


def stack_process(a: argparse.Namespace, name: str, model_dir: str, log_dir: str) -> StackProcess:
    """The side's `pdserve up` (bench/serve_stack.py): its prefix cache and routing policy (SIDES)."""
    cache, policy = SIDES[name]
    sp = StackProcess(argparse.Namespace(**{**vars(a), "policy": policy}), model_dir, log_dir)
    sp.cmd += [
        "--decode-instances",
        str(a.decode_instances),
        "--max-kv-tokens",
        str(a.max_kv_tokens),
        "--prefix-cache",
        cache,
    ]
    return sp


def run_side(name: str, a, model_dir: str, tok) -> dict:
    idle = wait_until_idle(a.idle_wait)
    sp = stack_process(a, name, model_dir, tempfile.mkdtemp(prefix=f"pdserve-bench-prefix-{name}-"))
    log(f"{name}: {' '.join(sp.cmd[3:])}")
    try:
        startup = sp.start(a.ready_timeout)
        urls = stack_urls(sp.lines)
        before = counters(urls)
        result = asyncio.run(workload(sp.url, sp.model, tok, a))
        after = counters(urls)
    finally:
        rc = sp.stop()
    delta = {k: after[k] - before[k] for k in after}
    n = result["requests"]
    result.update(
        command=" ".join(["pdserve", *sp.cmd[3:]]),
        startup_s=startup,
        rc=rc,
        idle_before=idle,
        instance_counters=delta,
        prefill_hit_rate=delta["prefix_hit_tokens"] / result["prompt_tokens"],
        kv_bytes_per_request=delta["transfer_bytes"] / n,
        kv_skipped_bytes_per_request=delta["transfer_skipped_bytes"] / n,
    )
    shipped = delta["transfer_bytes"] + delta["transfer_skipped_bytes"]
    result["decode_hit_share"] = delta["transfer_skipped_bytes"] / shipped if shipped else 0.0
    log(
        f"{name}: TTFT p50 {result['ttft_p50_ms']:.0f} ms, prefill hit rate {result['prefill_hit_rate']:.2f}, "
        f"KV {result['kv_bytes_per_request'] / 1e6:.2f} MB/request sent, "
        f"{result['kv_skipped_bytes_per_request'] / 1e6:.2f} MB skipped"
    )
    return result


def summary_rows(doc: dict, a: argparse.Namespace) -> list[dict]:
    """The README table's rows (bench/table.py)."""
    h, base, cached = doc["headline"], doc["sides"]["baseline"], doc["sides"]["cached"]
    workload = (
        f"{a.conversations} conversations x {a.turns} turns, {a.system_tokens}-token shared system prompt, "
        f"{a.prefill_instances}P + {a.decode_instances}D"
    )
    return [
        {
            "claim": f"TTFT p50, prefix caches + cache_aware, {workload}",
            "result": f"{h['ttft_p50_ratio']:.2f}x ({base['ttft_p50_ms']:.0f} ms / {cached['ttft_p50_ms']:.0f} ms); "
            f"prefill hit rate {h['prefill_hit_rate']:.2f}",
            "baseline": "--prefix-cache off, --policy round_robin, same workload, 1 run each",
            "bound": None,
            "target": ">= 3x",
            "met": h["ttft_p50_ratio"] >= 3,
        },
        {
            "claim": f"KV bytes shipped per request, {workload}",
            "result": f"x{h['kv_bytes_per_request_ratio']:.2f} ({cached['kv_bytes_per_request'] / 1e6:.2f} MB vs "
            f"{base['kv_bytes_per_request'] / 1e6:.2f} MB); 1 - decode hit share {h['one_minus_decode_hit_share']:.2f}",
            "baseline": "--prefix-cache off, same workload",
            "bound": None,
            "target": "reduced by the cached share",
            "met": None,
        },
    ]


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, mk in (("baseline", "o-"), ("cached", "s-")):
        by_turn = doc["sides"][name]["ttft_p50_ms_by_turn"]
        ax.plot(range(1, len(by_turn) + 1), by_turn, mk, label=f"{name}: {' / '.join(SIDES[name])}")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT p50 {doc['headline']['ttft_p50_ratio']:.1f}x better with prefix caches + cache_aware")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pdserve.model.tokenizer import Tokenizer

    model_dir = resolve_model(a.model)
    tok = Tokenizer.from_pretrained(model_dir)
    os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))  # the stacks inherit it
    sides = {name: run_side(name, a, model_dir, tok) for name in SIDES}
    base, cached = sides["baseline"], sides["cached"]
    doc = {
        "machine": machine_info(("torch", "httpx")),
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "model": model_dir,
        },
        "sides": sides,
        "headline": {
            "ttft_p50_ratio": base["ttft_p50_ms"] / cached["ttft_p50_ms"],
            "target": 3.0,
            "kv_bytes_per_request_ratio": cached["kv_bytes_per_request"]
            / max(base["kv_bytes_per_request"], 1),
            "one_minus_decode_hit_share": 1 - cached["decode_hit_share"],
            "prefill_hit_rate": cached["prefill_hit_rate"],
        },
    }
    doc["summary"] = summary_rows(doc, a)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "prefix_cache.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, a.out / "prefix_cache.png")
    h = doc["headline"]
    print(
        f"{'side':10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'e2e p50 ms':>11} {'hit rate':>9} {'KV MB/req':>10}"
    )
    for name, s in sides.items():
        print(
            f"{name:10} {s['ttft_p50_ms']:12.0f} {s['ttft_p99_ms']:12.0f} {s['e2e_p50_ms']:11.0f} "
            f"{s['prefill_hit_rate']:9.2f} {s['kv_bytes_per_request'] / 1e6:10.3f}"
        )
    print(
        f"headline: TTFT p50 {h['ttft_p50_ratio']:.2f}x better (target {h['target']:.0f}x); KV bytes per request "
        f"x{h['kv_bytes_per_request_ratio']:.2f} (1 - decode hit share = {h['one_minus_decode_hit_share']:.2f}); "
        f"prefill hit rate {h['prefill_hit_rate']:.2f}"
    )


if __name__ == "__main__":
    main()
