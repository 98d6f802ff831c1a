"""One GLM-5 layer on one GPU at the real dims, per rank: decode time against the HBM bound, prefill
against the FLOP bound (issue 39's targets). Random weights are made on the device (no checkpoint).

Shapes (bench/gpu_layer_parts.rank_shape): tp1 (the whole layer), tp8 (heads and each expert's
intermediate size / 8: experts [256, 2048/8, 6144]), ep8 (heads / 8, 32 whole experts). For tp8 and
ep8 a request's cache is split over the 8 ranks (DCP) and a query reads its share of the indexer's
top-k on each. Collectives are not timed: these are one rank's computations.

Rows (JSON `rows`, each with phase, shape, batch, context, weight_dtype, graphs, ms, bound_ms and
of_bound = bound_ms / ms):
  peak          measured HBM read rate (a sum over 4 GiB) and bf16 / fp8 matmul rates (8192^3):
                the bounds below divide by these, not by datasheet numbers
  moe_decode    the MoE block (router, routed experts, shared expert) on a decode batch; bound: the
                bytes it must read once (the experts the batch chose, the shared expert, the router)
                over the read rate, or its FLOPs over the matmul rate, whichever is larger
  layer_decode  the whole layer (norms, MLA projections, indexer over the rank's cache, top-k,
                attention, MoE) at 8k and 32k context; bound as above plus the cache the step reads
                (every index key, the selected latent rows)
  prefill       one 4096-token chunk (a prompt's first) through the whole layer; bound: the FLOPs
                the chunk needs (the selected keys only) over the matmul rate of its weight dtype
Each row runs eager and captured in a CUDA graph (graphs true: replays of one captured call).
`--moe-ops torch` rows are today's grouped loop (it syncs, so eager only): the baseline.

Run on a GPU:  python bench/gpu_layer.py [--out bench/results/gpu_layer.json] [--total-cap-s 420]
Smoke (CPU, tiny dims, CI):  python bench/gpu_layer.py --smoke --out /tmp/gpu_layer.json
The JSON is rewritten after every group of rows, so a run stopped at its time cap keeps what it did.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_layer_parts import (  # noqa: E402
    SHAPES,
    DenseDecodeBackend,
    PrefillBackend,
    active_params,
    build_layer,
    dense_bytes,
    expert_bytes,
    rank_shape,
    used_experts,
)

from pdserve.engine.gemm_ops import gather_facts, select_linear_ops, select_moe_ops, set_gemm_ops  # noqa: E402
from pdserve.model.rope import RotaryEmbedding  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_layer.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, iters: int, repeats: int) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls, in ms."""
    fn()
    sync(device)
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        per.append((time.perf_counter() - t0) * 1000 / iters)
    return statistics.median(per)


def graphed(fn, device):
    """fn captured in a CUDA graph (warmed up on a side stream first): returns the replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def peaks(device: torch.device, smoke: bool) -> dict:
    """Measured read rate (GB/s) and matmul rates (TFLOP/s) of this device."""
    n = 256 if smoke else 8192
    big = torch.empty((64 << 20) if smoke else (2 << 30), dtype=torch.bfloat16, device=device).normal_()
    read_s = time_ms(lambda: big.sum(), device, 3 if smoke else 20, 3) / 1000
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    mm_s = time_ms(lambda: a @ a, device, 3 if smoke else 20, 3) / 1000
    out = {"read_gbps": big.numel() * 2 / read_s / 1e9, "bf16_tflops": 2 * n**3 / mm_s / 1e12}
    out["fp8_tflops"] = out["bf16_tflops"]
    if device.type == "cuda":
        a8 = a.to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        mm8_s = time_ms(
            lambda: torch._scaled_mm(a8, a8.t(), one, one, out_dtype=torch.bfloat16), device, 20, 3
        )
        out["fp8_tflops"] = 2 * n**3 / (mm8_s / 1000) / 1e12
    return {k: float(f"{v:.4g}") for k, v in out.items()}


def bound(nbytes: int, flops: float, pk: dict, weight_dtype: str) -> dict:
    hbm = nbytes / (pk["read_gbps"] * 1e9) * 1000
    flop = flops / (pk[f"{'fp8' if weight_dtype == 'fp8' else 'bf16'}_tflops"] * 1e12) * 1000
    return {
        "bytes": nbytes,
        "flops": flops,
        "hbm_bound_ms": hbm,
        "flop_bound_ms": flop,
        "bound_ms": max(hbm, flop),
    }


class Run:
    """Rows, the JSON written after each group, and the time caps."""

    def __init__(self, args, device):
        self.args, self.device, self.t0 = args, device, time.monotonic()
        self.doc = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "rows": [],
            "skipped": [],
            "errors": [],
        }

    def left_s(self) -> float:
        return self.args.total_cap_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.doc["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.doc, indent=1) + "\n")

    def row(self, row: dict, fn, graphs: bool) -> None:
        """Times fn (eager or captured) and appends the row; an error is a row of its own."""
        key = {k: row[k] for k in ("phase", "shape", "batch", "context", "weight_dtype")} | {"graphs": graphs}
        if self.left_s() < 0:
            self.doc["skipped"].append(key)
            return
        try:
            call = graphed(fn, self.device) if graphs else fn
            ms = time_ms(call, self.device, self.args.iters, self.args.repeats)
        except Exception as e:  # one kernel that cannot run must not lose the other rows
            self.doc["errors"].append(key | {"error": f"{type(e).__name__}: {e}"[:500]})
            print(f"error {key}: {e}", file=sys.stderr, flush=True)
            return
        r = row | {"graphs": graphs, "ms": round(ms, 4)}
        r["of_bound"] = round(r["bound_ms"] / ms, 3)
        r["bound_ms"], r["hbm_bound_ms"], r["flop_bound_ms"] = (
            round(r[k], 4) for k in ("bound_ms", "hbm_bound_ms", "flop_bound_ms")
        )
        self.doc["rows"].append(r)
        print(json.dumps(r), flush=True)


def scaled_mm_works(device: torch.device) -> str | None:
    """None when torch's block-scaled scaled_mm runs here and agrees with the dequantized product
    (M 128, K 6144, N 2048), else why not: the fp8 rows then use the triton GEMM for every product,
    so one library call that fails does not cost every many-row fp8 row."""
    if device.type != "cuda":
        return "not cuda"
    try:
        from pdserve.model.moe_ops import dequant_linear
        from pdserve.model.quant import FP8_BLOCK, quantize_fp8
        from pdserve.model.triton_gemm import scaled_mm_linear

        x = torch.randn(128, 6144, device=device).to(torch.bfloat16)
        w, s = quantize_fp8(torch.randn(2048, 6144, device=device) / 80, FP8_BLOCK)
        got, want = scaled_mm_linear(x, w, s).float(), dequant_linear(x.float(), w, s).float()
        err = ((got - want).norm() / want.norm()).item()
        return None if err < 0.05 else f"scaled_mm's product is off by {err:.3g} (relative)"
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:300]


def ops_for(layer, device, weight_dtype: str, moe_ops: str, no_scaled_mm: bool) -> dict:
    wd = torch.float8_e4m3fn if weight_dtype == "fp8" else layer.mlp.experts.gate_up_proj.dtype
    facts = gather_facts(device, wd, (128, 128) if weight_dtype == "fp8" else None)
    linear = select_linear_ops("auto", facts).name
    ops = {
        "linear_ops": "triton" if linear == "scaled_mm" and no_scaled_mm else linear,
        "moe_ops": select_moe_ops(moe_ops, facts).name,
    }
    set_gemm_ops(layer, ops["linear_ops"], ops["moe_ops"])
    return ops


@torch.no_grad()
def group(run: Run, shape_name: str, weight_dtype: str, pk: dict) -> None:
    """Every row of one (shape, weight dtype): one layer built, timed in each phase, freed."""
    a, device = run.args, run.device
    shape = rank_shape(shape_name, a.smoke)
    cfg = shape.cfg
    layer = build_layer(shape, device, weight_dtype)
    dtype = layer.input_layernorm.weight.dtype
    g = torch.Generator(device=device).manual_seed(2)
    rope = RotaryEmbedding(cfg.rope, max(a.contexts) + 2)
    # today's grouped loop first (tp1 bf16): the triton ops fold the shared expert into the experts
    moe_ops_list = (["torch"] if shape_name == "tp1" and weight_dtype == "bf16" else []) + ["auto"]
    for moe_ops in moe_ops_list:
        ops = ops_for(layer, device, weight_dtype, moe_ops, bool(run.doc.get("scaled_mm_blocker")))
        graph_modes = [False, True] if device.type == "cuda" and ops["moe_ops"] != "torch" else [False]
        for batch in a.batches if moe_ops == "auto" else [b for b in a.batches if b in (1, 32)]:
            x = torch.randn(batch, cfg.hidden_size, generator=g, device=device).to(dtype)
            n_used = used_experts(layer, x)
            nbytes = dense_bytes(layer, moe_only=True) + expert_bytes(layer.mlp.experts, n_used)
            per_tok = cfg.num_experts_per_tok if shape.first_expert is None else cfg.num_experts_per_tok / 8
            flops = 2 * batch * active_params(layer, True, per_tok)
            base = {"phase": "moe_decode", "shape": shape_name, "batch": batch, "context": None}
            base |= {
                "weight_dtype": weight_dtype,
                **ops,
                "experts_used": n_used,
                **bound(nbytes, flops, pk, weight_dtype),
            }
            for graphs in graph_modes:
                run.row(base, lambda x=x: layer.mlp(x), graphs)
        run.save()
        if moe_ops != "auto":
            continue
        for context in a.contexts:
            for batch in a.batches:
                if run.left_s() < 0:
                    break
                backend = DenseDecodeBackend(
                    cfg, batch, shape.context_share(context), shape.topk_share(), device, dtype
                )
                x = torch.randn(batch, cfg.hidden_size, generator=g, device=device).to(dtype)
                cos, sin = rope(torch.full((batch,), context, device=device), dtype)
                n_used = used_experts(layer, x)
                nbytes = (
                    dense_bytes(layer, False) + expert_bytes(layer.mlp.experts, n_used) + backend.read_bytes()
                )
                per_tok = (
                    cfg.num_experts_per_tok if shape.first_expert is None else cfg.num_experts_per_tok / 8
                )
                H, Hi = cfg.num_heads, cfg.index_n_heads
                entry, S = cfg.kv_entry_dim, backend.kv.shape[1]
                attn_flops = batch * (
                    2 * H * backend.topk * (entry + cfg.kv_lora_rank) + 2 * Hi * S * cfg.index_head_dim
                )
                flops = 2 * batch * active_params(layer, False, per_tok) + attn_flops
                base = {"phase": "layer_decode", "shape": shape_name, "batch": batch, "context": context}
                base |= {
                    "weight_dtype": weight_dtype,
                    **ops,
                    "experts_used": n_used,
                    **bound(nbytes, flops, pk, weight_dtype),
                }
                for graphs in graph_modes:
                    run.row(base, lambda x=x, cos=cos, sin=sin, b=backend: layer(x, cos, sin, b), graphs)
                del backend
            run.save()
        if shape_name == "tp1" and a.prefill_tokens:
            prefill(run, layer, cfg, ops, weight_dtype, pk, rope)
            run.save()


def prefill(run: Run, layer, cfg, ops, weight_dtype: str, pk: dict, rope) -> None:
    T, device = run.args.prefill_tokens, run.device
    dtype = layer.input_layernorm.weight.dtype
    x = torch.randn(T, cfg.hidden_size, device=device).to(dtype)
    cos, sin = rope(torch.arange(T, device=device), dtype)
    backend = PrefillBackend(cfg)
    keys = torch.minimum(torch.arange(1, T + 1), torch.tensor(cfg.index_topk)).sum().item()  # selected
    causal = T * (T + 1) // 2  # the indexer scores every earlier key
    attn_flops = 2 * cfg.num_heads * keys * (cfg.kv_entry_dim + cfg.kv_lora_rank)
    attn_flops += 2 * cfg.index_n_heads * causal * cfg.index_head_dim
    flops = 2 * T * active_params(layer, False, cfg.num_experts_per_tok) + attn_flops
    b = bound(0, flops, pk, weight_dtype)
    row = {
        "phase": "prefill",
        "shape": "tp1",
        "batch": 1,
        "context": T,
        "weight_dtype": weight_dtype,
        **ops,
        **b,
    }
    before = len(run.doc["rows"])
    run.row(row, lambda: layer(x, cos, sin, backend), False)
    if len(run.doc["rows"]) > before:
        r = run.doc["rows"][-1]
        r["tokens_per_s"] = round(T / (r["ms"] / 1000), 1)


def summary(rows: list[dict]) -> list[dict]:
    """The issue's targets against the best matching rows (graphs where measured)."""

    def best(**want):
        hits = [r for r in rows if all(r.get(k) == v for k, v in want.items())]
        return max(hits, key=lambda r: r["of_bound"], default=None)

    out = []
    for shape in SHAPES:
        for label, want, target in (
            ("decode, one MoE layer, batch 1, fp8", dict(phase="moe_decode", batch=1), 0.5),
            ("decode, one MoE layer, batch 32, fp8", dict(phase="moe_decode", batch=32), 0.7),
            ("decode, whole layer, batch 1, 32k, fp8, graphs", dict(phase="layer_decode", batch=1, context=32768, graphs=True), 0.5),
            ("decode, whole layer, batch 32, 32k, fp8, graphs", dict(phase="layer_decode", batch=32, context=32768, graphs=True), 0.5),
        ):  # fmt: skip
            r = best(shape=shape, weight_dtype="fp8", moe_ops="triton", **want)
            if r is not None:
                out.append({"measure": f"{shape}: {label}", "ms": r["ms"], "bound_ms": r["bound_ms"],
                            "of_bound": r["of_bound"], "target": target, "met": r["of_bound"] >= target})  # fmt: skip
    for wd in ("bf16", "fp8"):
        r = best(phase="prefill", weight_dtype=wd)
        if r is not None:
            out.append({"measure": f"tp1: prefill, 4096-token chunk, one layer, {wd}", "ms": r["ms"],
                        "bound_ms": r["bound_ms"], "of_bound": r["of_bound"], "target": 0.4, "met": r["of_bound"] >= 0.4})  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--smoke", action="store_true", help="tiny dims on this machine's device (CPU in CI)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--dtypes", default="fp8,bf16", help="weight dtypes, in the order they run")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="0: no prefill rows")
    p.add_argument("--iters", type=int, default=20, help="calls per timing")
    p.add_argument("--repeats", type=int, default=3, help="timings per row (the median is kept)")
    p.add_argument(
        "--total-cap-s", type=float, default=420.0, help="rows left when this runs out are skipped"
    )
    a = p.parse_args(argv)
    a.batches = [int(b) for b in a.batches.split(",")]
    a.contexts = [int(c) for c in a.contexts.split(",")]
    if a.smoke:
        a.batches, a.contexts = a.batches[:2], [min(c, 64) for c in a.contexts[:1]]
        a.prefill_tokens, a.iters, a.repeats = min(a.prefill_tokens, 32), 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(2)
    run = Run(a, device)
    pk = peaks(device, a.smoke)
    run.doc["peak"] = pk
    run.doc["scaled_mm_blocker"] = scaled_mm_works(device)
    print(json.dumps(pk), "scaled_mm:", run.doc["scaled_mm_blocker"] or "works", flush=True)
    run.save()
    for shape in a.shapes.split(","):
        for wd in a.dtypes.split(","):
            try:
                group(run, shape, wd, pk)  # its layer is freed on return
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:  # a shape that cannot be built (memory, a kernel) must not stop the rest
                run.doc["errors"].append(
                    {"shape": shape, "weight_dtype": wd, "error": f"{type(e).__name__}: {e}"[:500]}
                )
                print(f"error {shape} {wd}: {e}", file=sys.stderr, flush=True)
            run.doc["summary"] = summary(run.doc["rows"])
            run.save()
    print(json.dumps(run.doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
