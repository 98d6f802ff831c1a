"""`pdserve admin ...`: operator tools.

Today `capacity` works offline from a config.json. The router-backed form (`pdserve admin --router URL
capacity`) will add --router to the group callback, so group options stay generic and each
command's offline inputs (--config) are command options; both forms can coexist.
Nothing heavy is imported at module import time: `pdserve --help` must stay fast.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

admin_app = typer.Typer(
    help="Operator tools: inspect a deployment's sizing (capacity) and, later, a running router.",
    no_args_is_help=True,
)


class KVCacheDType(str, Enum):
    auto = "auto"
    fp8_e4m3 = "fp8_e4m3"


class ModelDType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float64 = "float64"


_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
          "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@admin_app.callback()
def admin() -> None:
    """Operator tools: inspect a deployment's sizing (capacity) and, later, a running router."""


def parse_bytes(text: str) -> int:
    """'80GiB', '512MiB', '1.5GB', '1048576' -> bytes. Bare K/M/G/T and *iB are binary, *B decimal."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte count (e.g. 80GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--dcp-sizes must be comma-separated positive integers, got {text!r}")
    return sizes


def _load_config(path: Path):
    from .model.config import ModelConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path} is neither a config.json file nor a directory containing one")
    return ModelConfig.from_dict(json.loads(file.read_text()))


def capacity_report(cfg, kv_cache_dtype: str, dtype: str, dcp_sizes: list[int], page_size: int,
                    kv_memory: int | None) -> dict:
    """Everything `capacity` prints, as one JSON-able dict (rows per C_d, one entry per index mode)."""
    from .engine import capacity as cap

    rows = []
    for c in dcp_sizes:
        row: dict = {"dcp_size": c}
        for mode in cap.INDEX_MODES:
            entry = {"bytes_per_token": cap.bytes_per_token_per_rank(cfg, c, mode, kv_cache_dtype, dtype),
                     "factor": cap.capacity_factor(cfg, c, mode, kv_cache_dtype, dtype)}
            if kv_memory is not None:
                entry["tokens"] = cap.tokens_for_budget(cfg, kv_memory, c, mode, page_size, kv_cache_dtype, dtype)
            row[mode] = entry
        rows.append(row)
    return {"model_type": cfg.model_type, "kv_cache_dtype": kv_cache_dtype, "dtype": dtype,
            "entry_bytes": cap.entry_bytes(cfg, kv_cache_dtype, dtype),
            "index_bytes": cap.index_bytes(cfg, kv_cache_dtype, dtype),
            "page_size": page_size, "kv_memory": kv_memory, "rows": rows}


def _table(report: dict) -> str:
    budget = report["kv_memory"] is not None
    head = ["C_d", "bytes/tok/rank (copy)", "factor (copy)", "bytes/tok/rank (split)", "factor (split)"]
    head += ["tokens (copy)", "tokens (split)"] if budget else []
    lines = [head]
    for r in report["rows"]:
        cells = [str(r["dcp_size"])]
        for mode in ("copy", "split"):
            cells += [f"{r[mode]['bytes_per_token']:,.1f}", f"{r[mode]['factor']:.2f}"]
        cells += [f"{r[m]['tokens']:,}" for m in ("copy", "split")] if budget else []
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    body = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    intro = (f"{report['model_type']}, kv cache {report['kv_cache_dtype']} (model dtype {report['dtype']}): "
             f"E = {report['entry_bytes']:,} bytes/token, I = {report['index_bytes']:,} bytes/token")
    if budget:
        intro += f"\nper-rank KV budget {report['kv_memory']:,} bytes, pages of {report['page_size']} slots"
    return "\n".join([intro, *body])


@admin_app.command()
def capacity(
    config: Path = typer.Option(..., "--config", help="A model's config.json, or a checkpoint directory containing one."),
    kv_cache_dtype: KVCacheDType = typer.Option(KVCacheDType.auto, help="KV cache storage: auto (the model dtype) or fp8_e4m3 (1 byte per value, index keys with a float32 scale)."),
    dtype: ModelDType = typer.Option(ModelDType.bfloat16, help="Model dtype; sets the cache's bytes per value when --kv-cache-dtype is auto."),
    dcp_sizes: str = typer.Option("1,2,4,8", help="Comma-separated decode context-parallel sizes C_d to tabulate."),
    kv_memory: Optional[str] = typer.Option(None, help="Per-rank KV cache budget, e.g. 80GiB, 512MiB or plain bytes; adds the tokens each index mode holds."),
    page_size: int = typer.Option(64, min=1, help="Slots per page; must be a multiple of every C_d (pages are C_d-wide)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
):
    """Bytes per token per decode rank and the capacity factor over plain TP, copied vs split index."""
    try:
        cfg = _load_config(config)
        sizes = _parse_sizes(dcp_sizes)
        budget = parse_bytes(kv_memory) if kv_memory is not None else None
        bad = [c for c in sizes if page_size % c]
        if bad:
            raise ValueError(f"--page-size {page_size} is not a multiple of C_d {bad[0]}")
        report = capacity_report(cfg, kv_cache_dtype.value, dtype.value, sizes, page_size, budget)
    except ValueError as e:  # ConfigError and json.JSONDecodeError are ValueErrors too
        _fail(str(e))
    typer.echo(json.dumps(report) if as_json else _table(report))
