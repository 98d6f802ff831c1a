"""What the `pdserve` subcommands share: the typer app, the built-in model, the internal token,
secret masking, and `fail`; choice sets are in choices.py, flags declared on configs in flags.py. The commands live in main.py (tools), servers.py (prefill, decode)
and stack.py (router, up); main.py registers them in that order."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import env
from ..choices import AttentionOps, Device
from ..flags import ATTENTION_OPS_HELP, DEVICE_HELP, GPU_IDS_HELP

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode serving for long-context MLA + sparse-attention models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


BUILTIN_ARCH, BUILTIN_SIZE = "glm_moe_dsa", "small"


def builtin_model_dir() -> Path:
    """The built-in model, written once by `make-model` and reused."""
    root = Path(env.CACHE.text() or Path.home() / ".cache" / "pdserve")
    return root / "models" / f"{BUILTIN_SIZE}-{BUILTIN_ARCH}-seed0"


def ensure_builtin_model() -> Path:
    path = builtin_model_dir()
    if not (path / "config.json").is_file():
        from ..checkpoints.random_checkpoint import make_model

        print(f"building the built-in {BUILTIN_SIZE} {BUILTIN_ARCH} model in {path} (once)", file=sys.stderr)
        make_model(path, BUILTIN_ARCH, BUILTIN_SIZE, seed=0, overwrite=True)
    return path


def model_arg(model: Optional[Path], check_config: bool) -> Path:
    """--model, or the built-in model: built on first use, except by --check-config, which only reads config.json."""
    if check_config:
        from ..checkpoints.presets import hf_config
        from .check_plan import model_for_check

        return model_for_check(model, builtin_model_dir(), hf_config(BUILTIN_ARCH, BUILTIN_SIZE))
    return model or ensure_builtin_model()


INTERNAL_TOKEN_FILE_HELP = "A file holding the internal token (e.g. a mounted Kubernetes Secret)."


def internal_token(flag: Optional[str], file: Optional[Path], check_config: bool) -> Optional[str]:
    """The internal token (serving/auth.py), required unless only the config is checked."""
    from ..serving.auth import AuthConfigError, load_internal_token

    try:
        return load_internal_token(flag, str(file) if file else None, required=not check_config)
    except AuthConfigError as e:
        fail(str(e))


def stack_token(flag: Optional[str], file: Optional[Path]) -> str:
    from ..serving.auth import AuthConfigError, load_internal_token, new_token

    try:
        return load_internal_token(flag, str(file) if file else None, required=False) or new_token()
    except AuthConfigError as e:
        fail(str(e))


def masked(config: dict) -> dict:
    """A config for printing: secrets as "***" (or null when unset)."""
    return {
        k: ("***" if v else None) if k in ("internal_token", "admin_token", "api_key") else v
        for k, v in config.items()
    }


def fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


# the option every server command declares beside its config's fields
InternalTokenFileOpt = Annotated[Optional[Path], typer.Option(help=INTERNAL_TOKEN_FILE_HELP)]


# generate's device options (the servers' and up's come from their config fields)
DeviceOpt = Annotated[Device, typer.Option(help=DEVICE_HELP)]
GpuIdsOpt = Annotated[Optional[str], typer.Option(help=GPU_IDS_HELP)]
AttentionOpsOpt = Annotated[AttentionOps, typer.Option(help=ATTENTION_OPS_HELP)]


def gpu_ids_value(text: Optional[str]) -> tuple[int, ...]:
    """--gpu-ids "0,1" -> (0, 1) (runtime/placement.py)."""
    from ..runtime.placement import parse_gpu_ids

    return parse_gpu_ids(text)


def device_args(device: Device, gpu_ids: Optional[str]) -> dict:
    """The config fields of --device / --gpu-ids (runtime/device.py)."""
    return {"device": device.value, "gpu_ids": gpu_ids_value(gpu_ids)}


def check_gpus(cfg, world_size: int) -> None:
    """Before anything starts: the GPUs the ranks need exist, and `--attention-ops flashinfer` or
    `triton` (or `auto` with an fp8 cache on cuda), an explicit `--linear-ops` or `--moe-ops` can
    run there (else a clear error, never a fallback)."""
    import torch

    from ..engine.attn_ops import gather_facts, select_attention_ops
    from ..engine.llm_engine import parse_dtype
    from ..model.config import ModelConfig
    from ..runtime.device import check_devices

    nodes = getattr(cfg, "nnodes", 1)
    plan = check_devices(cfg.device, world_size // nodes, cfg.gpu_ids, nodes=nodes)
    if {cfg.linear_ops, cfg.moe_ops} - {"auto", "torch"}:
        from ..engine import gemm_ops

        dev = torch.device("cuda", plan.gpus[0]) if plan.device == "cuda" else torch.device("cpu")
        facts = gemm_ops.gather_facts(dev, parse_dtype(cfg.dtype))  # the loader keeps the run dtype
        gemm_ops.select_linear_ops(cfg.linear_ops, facts)
        gemm_ops.select_moe_ops(cfg.moe_ops, facts)
    kv = getattr(cfg, "kv_cache_dtype", "auto")
    if cfg.attention_ops in ("flashinfer", "triton") or (plan.device == "cuda" and kv != "auto"):
        dev = torch.device("cuda", plan.gpus[0]) if plan.device == "cuda" else torch.device("cpu")
        mcfg = ModelConfig.from_pretrained(cfg.model)
        select_attention_ops(cfg.attention_ops, gather_facts(dev, parse_dtype(cfg.dtype), mcfg, kv))
