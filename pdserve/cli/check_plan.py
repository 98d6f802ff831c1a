"""What `--check-config` adds for a model: topology, bytes of weights per rank, KV cache per rank.

Works from config.json alone (a directory with no weights is fine: the model is built on the meta
device), and never builds the built-in model: without --model it checks the built-in preset's
config and tokenizer (written to a temporary directory, no weights) unless the built-in model is
already on disk.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache, partial
from pathlib import Path

from ..kvcache import capacity
from ..runtime.memory_check import DEFAULT_GPU_MEMORY_UTILIZATION, WORKSPACE_BYTES, kv_tokens_for_memory


def model_for_check(model: Path | None, builtin_dir: Path, builtin_config: dict) -> Path:
    if model is not None:
        return model
    if (builtin_dir / "config.json").is_file():
        return builtin_dir
    from ..checkpoints.bpe_builder import write_tokenizer_files

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-check-"))
    atexit.register(shutil.rmtree, tmp, True)
    (tmp / "config.json").write_text(json.dumps(builtin_config))
    # the router checks its tokenizer: the built-in one is written in well under a second, the weights never
    write_tokenizer_files(tmp, builtin_config["vocab_size"], builtin_config["max_position_embeddings"])
    return tmp


def _model(path: str):
    from ..model.config import ModelConfig

    return ModelConfig.from_pretrained(path)


def _weights(mcfg, dtype: str):
    from ..runtime.weight_plan import param_bytes

    return param_bytes(mcfg, dtype)


def _quant(mcfg, keep_fp8: bool = False) -> str:
    q = mcfg.quantization
    if q is None:
        return "none"
    kept = (
        "kept fp8 where a rank's slice falls on blocks"
        if keep_fp8
        else "dequantized to the run dtype at load"
    )
    return f"{q.method} {q.block[0]}x{q.block[1]} blocks ({kept})"


def rank_weight_bytes(
    model: str,
    dtype: str,
    tp_size: int,
    dcp_size: int,
    replicate_q: bool,
    keep_fp8: bool,
    moe_ep: bool = False,
):
    """Each decode rank's weight bytes by dtype, from its meta-device model (model/shard.py): what
    the rank would allocate, fp8 weights and their block scales included (with --moe-ep: its
    whole experts, which stay fp8 where intermediate slices would not fall on blocks). Built once
    per (checkpoint config as it is now, shape) in a process: a W = 8 plan builds eight models."""
    stamp = Path(model, "config.json").read_bytes() if Path(model, "config.json").is_file() else b""
    return [
        dict(d)
        for d in _rank_weight_bytes(model, stamp, dtype, tp_size, dcp_size, replicate_q, keep_fp8, moe_ep)
    ]


@lru_cache(maxsize=8)
def _rank_weight_bytes(model, _config: bytes, dtype, tp_size, dcp_size, replicate_q, keep_fp8, moe_ep):
    from ..decode_server.tp import shard_decode_model
    from ..engine.llm_engine import parse_dtype
    from ..model.shard import weight_bytes_by_dtype
    from ..model.weights import rank_model

    out = []
    for rank in range(tp_size):
        meta = rank_model(
            model,
            parse_dtype(dtype),
            shard=partial(
                shard_decode_model,
                rank=rank,
                world=tp_size,
                dcp=dcp_size,
                replicate_q=replicate_q,
                moe_ep=moe_ep,
            ),
            keep_fp8=keep_fp8,
        )
        out.append(weight_bytes_by_dtype(meta))
    return tuple(out)


def prefill_plan(
    model: str, cp_size: int, cache: str, moe_tp: bool, dtype: str, slots: int, moe_ep: bool = False
) -> dict:
    mcfg = _model(model)
    per_token = capacity.entry_bytes(mcfg, "auto", dtype) + capacity.index_bytes(mcfg, "auto", dtype)
    kv = slots * per_token if cache == "full" else -(-slots * per_token // cp_size)
    return {
        "model_type": mcfg.model_type,
        "checkpoint_quantization": _quant(mcfg),
        "topology": f"1 prefill instance of {cp_size} rank(s) (context parallel, cache {cache})"
        + (f", experts EP={cp_size}" if moe_ep and cp_size > 1 else ""),
        "ranks": cp_size,
        "weight_bytes_per_rank": _weights(mcfg, dtype).prefill_rank(cp_size, moe_tp, moe_ep),
        "kv_tokens": slots,
        "kv_bytes_per_rank": kv,
    }


def decode_plan(
    model: str,
    tp_size: int,
    dcp_size: int,
    dcp_index: str,
    replicate_q: bool,
    dtype: str,
    kv_cache_dtype: str,
    page_size: int,
    slots: int | None,
    gpu_memory: int | None = None,
    keep_fp8: bool = False,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    moe_ep: bool = False,
) -> dict:
    """keep_fp8: the ranks keep an fp8 checkpoint's weights fp8 (--device cuda without --dequantize).
    slots None: the ranks size the pool from gpu_memory_utilization of their GPUs at startup; with
    gpu_memory the plan shows what that gives on such a GPU (nothing else in use).
    moe_ep: routed experts by id across the ranks (the per-rank bytes come from the ranks' meta models)."""
    mcfg = _model(model)
    by_rank = rank_weight_bytes(model, dtype, tp_size, dcp_size, replicate_q, keep_fp8, moe_ep)
    weights = max(sum(r.values()) for r in by_rank)
    page = capacity.page_bytes_per_rank(mcfg, dcp_size, dcp_index, page_size, kv_cache_dtype, dtype)
    u, workspace = gpu_memory_utilization, WORKSPACE_BYTES["cuda"]
    fit = (
        None
        if gpu_memory is None
        else kv_tokens_for_memory(gpu_memory, 0, weights, workspace, u, page, page_size)
    )
    if slots is None:
        slots, source = (
            fit,
            f"--gpu-memory-utilization {u} of "
            + ("--gpu-memory" if fit is not None else "each GPU at startup"),
        )
    else:
        source = "--max-kv-tokens / --kv-memory"
    plan = {
        "model_type": mcfg.model_type,
        "checkpoint_quantization": _quant(mcfg, keep_fp8),
        "topology": f"1 decode instance of {tp_size} rank(s): TP={tp_size}, DCP C_d={dcp_size}, index {dcp_index}"
        + (f", experts EP={tp_size}" if moe_ep and tp_size > 1 else ""),
        "ranks": tp_size,
        "dtype": dtype,
        "weight_bytes_per_rank": weights,
        "weight_bytes_by_dtype_per_rank": by_rank,
        "kv_tokens": slots,  # None: chosen by the ranks at startup
        "kv_tokens_from": source,
        "kv_bytes_per_rank": None if slots is None else slots // page_size * page,
    }
    if gpu_memory is not None:
        from ..runtime.weight_plan import gpu_plan

        sizes = sorted({1, 2, 4, 8, dcp_size})
        plan["gpu"] = {
            "gpu_memory": gpu_memory,
            "fits": weights + plan["kv_bytes_per_rank"] + workspace <= gpu_memory,
            "weights_fit": weights <= gpu_memory,
            "workspace_bytes": workspace,
            "gpu_memory_utilization": u,
            # the KV tokens one instance holds in what the weights and the workspace leave of
            # gpu_memory_utilization of each GPU (what --gpu-memory-utilization gives at startup)
            "kv_tokens_fit": fit,
            "rows": gpu_plan(
                mcfg,
                _weights(mcfg, dtype),
                gpu_memory,
                [c for c in sizes if page_size % c == 0],
                page_size,
                kv_cache_dtype,
                dtype,
            ),
        }
    return plan


def gpu_table(gpu: dict, dtype: str) -> str:
    """Per C_d: the fewest ranks that hold the weights on one GPU each, and the KV tokens per instance."""
    lines = [f"on GPUs of {gpu['gpu_memory'] / 2**30:,.1f} GiB, weights in {dtype}:"]
    for r in gpu["rows"]:
        if r["ranks"] is None:
            lines.append(
                f"  C_d={r['dcp_size']}: the weights fit on no decode instance (too large even split over every head)"
            )
        else:
            lines.append(
                f"  C_d={r['dcp_size']}: {r['ranks']} ranks, weights {r['weight_bytes_per_rank'] / 2**30:,.2f} GiB"
                f" + KV {r['kv_bytes_per_rank'] / 2**30:,.2f} GiB per rank: {r['tokens_copy']:,} tokens "
                f"(copied index), {r['tokens_split']:,} (split index) per instance"
            )
    return "\n".join(lines)


def up_plan(
    model: str,
    prefill_instances: int,
    prefill_cp: int,
    decode_instances: int,
    decode_tp: int,
    decode_dcp: int,
    dcp_index: str,
    slots: int,
    dtype: str = "float32",
) -> dict:
    prefill = prefill_plan(model, prefill_cp, "full", False, dtype, slots)
    decode = decode_plan(model, decode_tp, decode_dcp, dcp_index, False, dtype, "auto", 64, slots)
    return {
        "topology": f"{prefill_instances} prefill x {prefill_cp} rank(s), {decode_instances} decode x "
        f"{decode_tp} rank(s) (C_d={decode_dcp}), 1 router; {prefill_instances * prefill_cp + decode_instances * decode_tp} ranks",
        "prefill": prefill,
        "decode": decode,
    }


def describe(plan: dict) -> str:
    """The plan as a few lines for a person (stderr); the JSON on stdout carries the same numbers."""
    parts = [plan] if "ranks" in plan else [plan["prefill"], plan["decode"]]
    lines = [plan["topology"]] if "ranks" not in plan else []
    for p in parts:
        lines.append(
            f"{p['topology']}: {p['model_type']}, checkpoint quantization {p['checkpoint_quantization']}"
        )
        kv = (
            f"{p['kv_tokens']:,} tokens, {p['kv_bytes_per_rank'] / 2**30:,.2f} GiB per rank"
            if p["kv_tokens"] is not None
            else "sized at startup"
        )
        source = f" ({p['kv_tokens_from']})" if "kv_tokens_from" in p else ""
        lines.append(
            f"  weights {p['weight_bytes_per_rank'] / 2**30:,.2f} GiB per rank; KV cache {kv}{source}"
        )
        if "weight_bytes_by_dtype_per_rank" in p:
            widest = max(p["weight_bytes_by_dtype_per_rank"], key=lambda d: sum(d.values()))
            lines.append(
                "  weights by dtype (largest rank): "
                + ", ".join(f"{k} {v / 2**30:,.2f} GiB" for k, v in sorted(widest.items()))
            )
        if "gpu" in p:
            g = p["gpu"]
            lines.append(
                f"  on {g['gpu_memory'] / 2**30:,.1f} GiB GPUs the weights "
                + ("fit" if g["weights_fit"] else "do NOT fit")
                + f"; {g['kv_tokens_fit']:,} KV tokens fit beside them"
            )
            lines.append(("  fits" if g["fits"] else "  does NOT fit") + " on one GPU per rank; sizing:")
            lines.append(gpu_table(p["gpu"], p.get("dtype", "the run dtype")))
    return "\n".join(lines)


def echo_plan(config: dict, plan: dict) -> None:
    """--check-config's answer: the config and its plan as one JSON line, the plan in words on stderr."""
    import typer

    typer.echo(describe(plan), err=True)
    typer.echo(json.dumps({**config, "plan": plan}))
