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
from pathlib import Path

from .engine import capacity


def model_for_check(model: Path | None, builtin_dir: Path, builtin_config: dict) -> Path:
    if model is not None:
        return model
    if (builtin_dir / "config.json").is_file():
        return builtin_dir
    from .model.bpe_builder import write_tokenizer_files

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-check-"))
    atexit.register(shutil.rmtree, tmp, True)
    (tmp / "config.json").write_text(json.dumps(builtin_config))
    # the router checks its tokenizer: the built-in one is written in well under a second, the weights never
    write_tokenizer_files(tmp, builtin_config["vocab_size"], builtin_config["max_position_embeddings"])
    return tmp


def _model(path: str):
    from .model.config import ModelConfig

    return ModelConfig.from_pretrained(path)


def _weights(mcfg, dtype: str):
    from .engine.weight_plan import param_bytes

    return param_bytes(mcfg, dtype)


def _quant(mcfg) -> str:
    q = mcfg.quantization
    return (
        "none"
        if q is None
        else f"{q.method} {q.block[0]}x{q.block[1]} blocks (dequantized to the run dtype at load)"
    )


def prefill_plan(model: str, cp_size: int, cache: str, moe_tp: bool, dtype: str, slots: int) -> dict:
    mcfg = _model(model)
    per_token = capacity.entry_bytes(mcfg, "auto", dtype) + capacity.index_bytes(mcfg, "auto", dtype)
    kv = slots * per_token if cache == "full" else -(-slots * per_token // cp_size)
    return {
        "model_type": mcfg.model_type,
        "checkpoint_quantization": _quant(mcfg),
        "topology": f"1 prefill instance of {cp_size} rank(s) (context parallel, cache {cache})",
        "ranks": cp_size,
        "weight_bytes_per_rank": _weights(mcfg, dtype).prefill_rank(cp_size, moe_tp),
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
    slots: int,
    gpu_memory: int | None = None,
) -> dict:
    mcfg = _model(model)
    page = capacity.page_bytes_per_rank(mcfg, dcp_size, dcp_index, page_size, kv_cache_dtype, dtype)
    plan = {
        "model_type": mcfg.model_type,
        "checkpoint_quantization": _quant(mcfg),
        "topology": f"1 decode instance of {tp_size} rank(s): TP={tp_size}, DCP C_d={dcp_size}, index {dcp_index}",
        "ranks": tp_size,
        "dtype": dtype,
        "weight_bytes_per_rank": _weights(mcfg, dtype).decode_rank(tp_size, dcp_size, replicate_q),
        "kv_tokens": slots,
        "kv_bytes_per_rank": slots // page_size * page,
    }
    if gpu_memory is not None:
        from .engine.weight_plan import gpu_plan

        sizes = sorted({1, 2, 4, 8, dcp_size})
        plan["gpu"] = {
            "gpu_memory": gpu_memory,
            "fits": plan["weight_bytes_per_rank"] + plan["kv_bytes_per_rank"] <= gpu_memory,
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
        lines.append(
            f"  weights {p['weight_bytes_per_rank'] / 2**30:,.2f} GiB per rank; KV cache "
            f"{p['kv_tokens']:,} tokens, {p['kv_bytes_per_rank'] / 2**30:,.2f} GiB per rank"
        )
        if "gpu" in p:
            lines.append(
                ("  fits" if p["gpu"]["fits"] else "  does NOT fit") + " on one GPU per rank; sizing:"
            )
            lines.append(gpu_table(p["gpu"], p.get("dtype", "the run dtype")))
    return "\n".join(lines)


def echo_plan(config: dict, plan: dict) -> None:
    """--check-config's answer: the config and its plan as one JSON line, the plan in words on stderr."""
    import typer

    typer.echo(describe(plan), err=True)
    typer.echo(json.dumps({**config, "plan": plan}))
