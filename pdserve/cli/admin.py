"""`pdserve admin ...`: operator tools.

`capacity --config` works offline from a config.json. With `--router URL` (a group option, with
`--token` or PDSERVE_ADMIN_TOKEN) the commands talk to a running router's /admin API:
`topology`, `add ROLE URL`, `remove URL`, `drain URL`, `undrain URL`, and `capacity` (live KV
tokens per instance). Every command prints a table, or JSON with --json.
Nothing heavy is imported at module import time: `pdserve --help` must stay fast.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .. import env
from ..choices import KVCacheDType, ModelDType
from ..flags import warn_secret_on_argv

admin_app = typer.Typer(
    help="Operator tools: a deployment's sizing (capacity --config) and a running router's topology.",
    no_args_is_help=True,
)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@admin_app.callback()
def admin(
    ctx: typer.Context,
    router: Optional[str] = typer.Option(
        None,
        help="Base URL of a running router, e.g. http://127.0.0.1:8000; the commands then use its /admin API.",
    ),
    token: Optional[str] = typer.Option(
        None, help="The router's admin token (default: the PDSERVE_ADMIN_TOKEN environment variable)."
    ),
) -> None:
    """Operator tools: a deployment's sizing (capacity --config) and a running router's topology."""
    if token is not None:
        warn_secret_on_argv("--token")
    token = token or env.ADMIN_TOKEN.text()
    ctx.obj = {"router": router.rstrip("/") if router else None, "token": token}


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
    from ..model.config import ModelConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{path} is neither a config.json file nor a directory containing one")
    return ModelConfig.from_dict(json.loads(file.read_text()))


def capacity_report(
    cfg, kv_cache_dtype: str, dtype: str, dcp_sizes: list[int], page_size: int, kv_memory: int | None
) -> dict:
    """Everything `capacity` prints, as one JSON-able dict (rows per C_d, one entry per index mode)."""
    from ..kvcache import capacity as cap

    rows = []
    for c in dcp_sizes:
        row: dict = {"dcp_size": c}
        for mode in cap.INDEX_MODES:
            entry = {
                "bytes_per_token": cap.bytes_per_token_per_rank(cfg, c, mode, kv_cache_dtype, dtype),
                "factor": cap.capacity_factor(cfg, c, mode, kv_cache_dtype, dtype),
            }
            if kv_memory is not None:
                entry["tokens"] = cap.tokens_for_budget(
                    cfg, kv_memory, c, mode, page_size, kv_cache_dtype, dtype
                )
            row[mode] = entry
        rows.append(row)
    return {
        "model_type": cfg.model_type,
        "kv_cache_dtype": kv_cache_dtype,
        "dtype": dtype,
        "entry_bytes": cap.entry_bytes(cfg, kv_cache_dtype, dtype),
        "index_bytes": cap.index_bytes(cfg, kv_cache_dtype, dtype),
        "page_size": page_size,
        "kv_memory": kv_memory,
        "rows": rows,
    }


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
    intro = (
        f"{report['model_type']}, kv cache {report['kv_cache_dtype']} (model dtype {report['dtype']}): "
        f"E = {report['entry_bytes']:,} bytes/token, I = {report['index_bytes']:,} bytes/token"
    )
    if budget:
        intro += f"\nper-rank KV budget {report['kv_memory']:,} bytes, pages of {report['page_size']} slots"
    return "\n".join([intro, *body])


@admin_app.command()
def capacity(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        help="A model's config.json, or a checkpoint directory containing one (offline sizing; without it, --router's live capacity).",
    ),
    kv_cache_dtype: KVCacheDType = typer.Option(
        KVCacheDType.auto,
        help="KV cache storage: auto (the model dtype) or fp8_e4m3 (1 byte per value, index keys with a float32 scale).",
    ),
    dtype: ModelDType = typer.Option(
        ModelDType.bfloat16,
        help="Model dtype; sets the cache's bytes per value when --kv-cache-dtype is auto.",
    ),
    dcp_sizes: str = typer.Option(
        "1,2,4,8", help="Comma-separated decode context-parallel sizes C_d to tabulate."
    ),
    kv_memory: Optional[str] = typer.Option(
        None,
        help="Per-rank KV cache budget, e.g. 80GiB, 512MiB or plain bytes; adds the tokens each index mode holds.",
    ),
    page_size: int = typer.Option(
        64, min=1, help="Slots per page; must be a multiple of every C_d (pages are C_d-wide)."
    ),
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="Memory of one GPU, e.g. 141GiB: adds, per C_d, the fewest decode ranks whose weights (in --dtype) fit one GPU each and the KV tokens per instance in what is left.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
):
    """Bytes per token per decode rank and the capacity factor over plain TP, copied vs split index;
    with --router instead of --config, the live KV tokens free/total of every instance."""
    if config is None:
        if not ctx.obj or not ctx.obj["router"]:
            _fail(
                "give --config (offline sizing) or `pdserve admin --router URL capacity` (a running router)"
            )
        _router_call(ctx, "GET", "/admin/capacity", None, as_json)
        return
    try:
        cfg = _load_config(config)
        sizes = _parse_sizes(dcp_sizes)
        budget = parse_bytes(kv_memory) if kv_memory is not None else None
        bad = [c for c in sizes if page_size % c]
        if bad:
            raise ValueError(f"--page-size {page_size} is not a multiple of C_d {bad[0]}")
        report = capacity_report(cfg, kv_cache_dtype.value, dtype.value, sizes, page_size, budget)
        if gpu_memory is not None:
            from ..runtime.weight_plan import gpu_plan, param_bytes

            gpu = parse_bytes(gpu_memory)
            report["gpu"] = {
                "gpu_memory": gpu,
                "rows": gpu_plan(
                    cfg,
                    param_bytes(cfg, dtype.value),
                    gpu,
                    sizes,
                    page_size,
                    kv_cache_dtype.value,
                    dtype.value,
                ),
            }
    except ValueError as e:  # ConfigError and json.JSONDecodeError are ValueErrors too
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(report))
        return
    typer.echo(_table(report))
    if "gpu" in report:
        from .check_plan import gpu_table

        typer.echo(gpu_table(report["gpu"], dtype.value))


# --- a running router's /admin API ----------------------------------------------------------------


def _router_call(ctx: typer.Context, method: str, path: str, body: dict | None, as_json: bool) -> None:
    import httpx

    obj = ctx.obj or {}
    if not obj.get("router"):
        _fail("this command needs the router: pdserve admin --router URL [--token T] ...")
    headers = {"Authorization": f"Bearer {obj['token']}"} if obj.get("token") else {}
    try:
        r = httpx.request(method, obj["router"] + path, json=body, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        _fail(f"cannot reach the router at {obj['router']}: {type(e).__name__}: {e}")
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": {"message": r.text[:300]}}
    if r.status_code != 200:
        message = answer.get("error", {}).get("message", answer) if isinstance(answer, dict) else answer
        typer.echo(f"error: HTTP {r.status_code}: {message}", err=True)
        raise typer.Exit(1)
    rows = answer["instances"] if "instances" in answer else [answer]
    typer.echo(json.dumps(answer) if as_json else topology_table(rows))


def topology_table(rows: list[dict]) -> str:
    """instance, role, ranks, CP or TP/DCP sizes, index mode, KV tokens free/total, cached (prefix
    cache, unreferenced) and in use, in-flight, health."""
    head = [
        "instance",
        "role",
        "ranks",
        "sizes",
        "index",
        "kv free/total",
        "cached",
        "in use",
        "in-flight",
        "health",
    ]
    lines = [head]
    for r in rows:
        sizes = (
            f"CP={r.get('cp_size')}"
            if r["role"] == "prefill"
            else f"TP={r.get('tp_size')} DCP={r.get('dcp_size')}"
        )
        kv = "-" if r.get("total_tokens") is None else f"{r.get('free_tokens'):,}/{r['total_tokens']:,}"
        health = (
            "draining" if r["draining"] else "healthy" if r["healthy"] else f"unhealthy: {r.get('error')}"
        )
        lines.append(
            [
                r["url"],
                r["role"],
                str(r.get("ranks", "-")),
                sizes,
                r.get("index_mode") or "-",
                kv,
                _tokens(r.get("cached_tokens")),
                _tokens(r.get("in_use_tokens")),
                str(r["in_flight"]),
                health,
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(line, widths)), line[-1]]).rstrip() for line in lines
    )


def _tokens(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


_JSON_HELP = "Print the router's JSON answer instead of the table."


@admin_app.command()
def topology(ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help=_JSON_HELP)):
    """Every instance the router knows: role, sizes, KV tokens, in-flight requests, health."""
    _router_call(ctx, "GET", "/admin/topology", None, as_json)


class Role(str, Enum):
    prefill = "prefill"
    decode = "decode"


@admin_app.command()
def add(
    ctx: typer.Context,
    role: Role = typer.Argument(..., help="The instance's role: prefill or decode."),
    url: str = typer.Argument(..., help="The instance's base URL, e.g. http://127.0.0.1:8101."),
    as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
):
    """Register an instance with the router; it takes requests once its health check passes."""
    _router_call(ctx, "POST", "/admin/add", {"role": role.value, "url": url}, as_json)


def _instance_command(name: str, summary: str, url_help: str) -> None:
    """`pdserve admin NAME URL [--json]`: POST /admin/NAME {"url": URL}."""

    def command(
        ctx: typer.Context,
        url: str = typer.Argument(..., help=url_help),
        as_json: bool = typer.Option(False, "--json", help=_JSON_HELP),
    ):
        _router_call(ctx, "POST", f"/admin/{name}", {"url": url}, as_json)

    command.__doc__ = summary
    admin_app.command(name)(command)


_instance_command(
    "remove",
    "Forget an instance: no new requests go to it; running ones finish.",
    "The base URL of the instance to forget.",
)
_instance_command(
    "drain",
    "Send no new requests to an instance; its running ones finish (undo with undrain).",
    "The base URL of the instance to drain.",
)
_instance_command(
    "flush",
    "Drop an instance's prefix cache: its unreferenced cached KV pages go back to the free pool.",
    "The base URL of the instance whose prefix cache to drop.",
)
_instance_command(
    "undrain", "Let a drained instance take new requests again.", "The base URL of a drained instance."
)
