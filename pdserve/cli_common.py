"""What the `pdserve` subcommands share: the typer app, the built-in model, the internal token,
secret masking, and `fail`. The commands live in cli.py (tools), cli_servers.py (prefill, decode)
and cli_stack.py (router, up); cli.py registers them in that order."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode serving for long-context MLA + sparse-attention models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Arch(str, Enum):
    glm_moe_dsa = "glm_moe_dsa"
    deepseek_v32 = "deepseek_v32"
    deepseek_v3 = "deepseek_v3"


class Size(str, Enum):
    tiny = "tiny"
    small = "small"
    mla = "mla"


class Quantize(str, Enum):
    fp8 = "fp8"


BUILTIN_ARCH, BUILTIN_SIZE = "glm_moe_dsa", "small"


def builtin_model_dir() -> Path:
    """The built-in model, written once by `make-model` and reused."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return root / "models" / f"{BUILTIN_SIZE}-{BUILTIN_ARCH}-seed0"


def ensure_builtin_model() -> Path:
    path = builtin_model_dir()
    if not (path / "config.json").is_file():
        from .model.random_checkpoint import make_model

        print(f"building the built-in {BUILTIN_SIZE} {BUILTIN_ARCH} model in {path} (once)", file=sys.stderr)
        make_model(path, BUILTIN_ARCH, BUILTIN_SIZE, seed=0, overwrite=True)
    return path


def model_arg(model: Optional[Path], check_config: bool) -> Path:
    """--model, or the built-in model: built on first use, except by --check-config, which only reads config.json."""
    if check_config:
        from .check_plan import model_for_check
        from .model.presets import hf_config

        return model_for_check(model, builtin_model_dir(), hf_config(BUILTIN_ARCH, BUILTIN_SIZE))
    return model or ensure_builtin_model()


SHUTDOWN_GRACE_HELP = (
    "Seconds running requests get to finish after SIGTERM: new requests and /health answer 503 "
    "(draining) at once; what still runs at the end gets an error; then exit 0. A second "
    "signal cuts it short."
)


INTERNAL_TOKEN_HELP = (
    "The internal token that authenticates pdserve's own processes to each other (instance HTTP "
    "APIs, side channel, data path); the same on the router and every instance. Default: "
    "$PDSERVE_INTERNAL_TOKEN. A value given here is visible in `ps`: prefer the variable or "
    "--internal-token-file."
)
INTERNAL_TOKEN_FILE_HELP = "A file holding the internal token (e.g. a mounted Kubernetes Secret)."


def internal_token(flag: Optional[str], file: Optional[Path], check_config: bool) -> Optional[str]:
    """The internal token (engine/auth.py), required unless only the config is checked."""
    from .engine.auth import AuthConfigError, load_internal_token

    try:
        return load_internal_token(flag, str(file) if file else None, required=not check_config)
    except AuthConfigError as e:
        fail(str(e))


def stack_token(flag: Optional[str], file: Optional[Path]) -> str:
    from .engine.auth import AuthConfigError, load_internal_token, new_token

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


class Transfer(str, Enum):
    tcp = "tcp"
    nixl = "nixl"


class DcpIndex(str, Enum):
    copy = "copy"
    split = "split"


# options several subcommands declare alike: one definition each
ModelOpt = Annotated[
    Optional[Path], typer.Option(help="Checkpoint directory. Default: the built-in small model.")
]
ShutdownGraceOpt = Annotated[float, typer.Option(min=0.0, help=SHUTDOWN_GRACE_HELP)]
InternalTokenOpt = Annotated[Optional[str], typer.Option("--internal-token", help=INTERNAL_TOKEN_HELP)]
InternalTokenFileOpt = Annotated[Optional[Path], typer.Option(help=INTERNAL_TOKEN_FILE_HELP)]


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class AttentionOps(str, Enum):
    auto = "auto"
    torch = "torch"
    flashinfer = "flashinfer"


DeviceOpt = Annotated[
    Device,
    typer.Option(
        help="Where the ranks run: cpu, or cuda (rank r on the r-th GPU of --gpu-ids; NCCL between ranks on distinct GPUs, "
        "the host comm for ranks sharing one). A GPU that is missing is a startup error."
    ),
]
GpuIdsOpt = Annotated[
    Optional[str],
    typer.Option(
        help="--device cuda: comma-separated GPU ordinals, one per rank (e.g. 0,0 puts two ranks on GPU 0). "
        "Default: rank r uses GPU r."
    ),
]
AttentionOpsOpt = Annotated[
    AttentionOps,
    typer.Option(
        help="Attention kernels: torch (any device and dtype), flashinfer (CUDA, bf16/fp16, MLA dims 512 + 64, "
        "flashinfer-python installed) or auto (flashinfer where it can run, else torch). The choice and its "
        "reason are printed at startup; flashinfer where it cannot run is an error."
    ),
]
DTYPE_HELP = "Weights, activations and KV cache dtype. Default: float32 on cpu, bfloat16 on cuda."


def device_args(device: Device, gpu_ids: Optional[str]) -> dict:
    """The config fields of --device / --gpu-ids (engine/device.py)."""
    from .engine.placement import parse_gpu_ids

    return {"device": device.value, "gpu_ids": parse_gpu_ids(gpu_ids)}


def check_gpus(cfg, world_size: int) -> None:
    """Before anything starts: the GPUs the ranks need exist, and `--attention-ops flashinfer` can
    run there (else a clear error, never a fallback)."""
    import torch

    from .engine.attn_ops import gather_facts, select_attention_ops
    from .engine.device import check_devices
    from .engine.llm_engine import parse_dtype
    from .model.config import ModelConfig

    plan = check_devices(cfg.device, world_size, cfg.gpu_ids)
    if cfg.attention_ops == "flashinfer":
        dev = torch.device("cuda", plan.gpus[0]) if plan.device == "cuda" else torch.device("cpu")
        mcfg = ModelConfig.from_pretrained(cfg.model)
        kv = getattr(cfg, "kv_cache_dtype", "auto")
        select_attention_ops("flashinfer", gather_facts(dev, parse_dtype(cfg.dtype), mcfg, kv))
