"""A sweep of the fused MoE kernel's tiles on the GPU (a tuning aid: its JSON is what
model/triton_moe.moe_config's numbers were chosen from, not a claim of its own).

Each product of fused_moe (gate/up: N = 2I, K = H; down: N = H, K = I) at GLM-5's tp1 dims, with
256 routed experts and the shared expert folded in as the 257th (9 pairs per token), fp8 weights:
  decode1   batch 1, w8a16, one pair a block (PER_PAIR)
  decode32  batch 32, pairs grouped by expert (moe_align, BLOCK_M 16), w8a8
for BLOCK_N x num_stages x split-K, each timed as CUDA-graph replays of the one launch, against
the bytes of the experts it reads (GB/s). Weights are random bytes (never NaN), made on the device.

Run on a GPU:  python bench/gpu_tune.py [--out bench/results/gpu_tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.model import triton_moe as tm  # noqa: E402

H, I, E, K = 6144, 2048, 257, 9  # experts with the shared one folded in; 8 routed + 1 shared per token


def graph_ms(fn, iters: int = 50) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / iters


def fp8_bytes(shape) -> torch.Tensor:
    """Random e4m3 values in [0, 0.5) (bytes 0..125: never NaN), made on the device."""
    return torch.empty(shape, dtype=torch.uint8, device="cuda").random_(0, 126).view(torch.float8_e4m3fn)


def cases():
    w13, w2 = fp8_bytes((E, 2 * I, H)), fp8_bytes((E, H, I))
    s13 = torch.full((E, 2 * I // 128, H // 128), 1e-3, device="cuda")
    s2 = torch.full((E, H // 128, I // 128), 1e-3, device="cuda")
    for name, tokens, per_pair, mode in (
        ("decode1", 1, True, tm.MODE_W8A16),
        ("decode32", 32, False, tm.MODE_W8A8),
    ):
        ids = torch.rand(tokens, E - 1, device="cuda").argsort(dim=1)[:, : K - 1]
        ids = torch.cat([ids, torch.full((tokens, 1), E - 1, device="cuda")], 1)
        pairs = tokens * K
        weights = torch.rand(pairs, device="cuda")
        x = torch.randn(tokens, H, device="cuda").bfloat16()
        h = torch.randn(pairs, I, device="cuda").bfloat16()
        if per_pair:
            sorted_ids = block_expert = ids.reshape(-1)
        else:
            sorted_ids, block_expert = tm.moe_align(ids, E, 16)
        ax, axs = tm.quantize_act(x) if mode == tm.MODE_W8A8 else (x, None)
        ah, ahs = tm.quantize_act(h) if mode == tm.MODE_W8A8 else (h, None)
        used = int(torch.unique(ids).numel())
        for product, a, a_s, w, s, n, top_k, rw in (
            ("gate_up", ax, axs, w13, s13, 2 * I, K, None),
            ("down", ah, ahs, w2, s2, H, 1, weights),
        ):
            out = torch.empty(pairs, n, dtype=torch.bfloat16, device="cuda")
            nbytes = used * w[0].numel()
            grouped = partial(tm._grouped_gemm, a, a_s, w, s, out, rw, sorted_ids, block_expert, top_k, mode)
            tiles = [
                tm.MoeConfig(16, n, tm.GROUP, 1, warps, stages, split)
                for n, warps, stages, split in itertools.product((32, 64), (4,), (3, 4, 6), (1, 2, 4, 8))
            ]
            yield name, product, "grouped", nbytes, partial(_grouped, grouped, per_pair), tiles


def _grouped(launch, per_pair: bool, cfg) -> None:
    launch(cfg, per_pair)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "gpu_tune.json")
    p.add_argument("--cap-s", type=float, default=150.0, help="configs left when this runs out are skipped")
    a = p.parse_args(argv)
    t0, rows = time.monotonic(), []
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    for name, product, kernel, nbytes, launch, configs in cases():
        for cfg in configs:
            if time.monotonic() - t0 > a.cap_s:
                break
            row = {"case": name, "product": product, "kernel": kernel, "block_n": cfg.block_n,
                   "warps": cfg.num_warps, "stages": cfg.num_stages, "split": cfg.split}  # fmt: skip
            try:
                ms = graph_ms(partial(launch, cfg))
                row |= {"ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 1)}
            except Exception as e:  # a config that does not fit (shared memory) is a row too
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1) + "\n")
    best = {}
    for r in rows:
        key = f"{r['case']} {r['product']} {r['kernel']}"
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    doc["best"] = best
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(best, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
