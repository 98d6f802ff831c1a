"""The names of --device, --gpu-ids and --attention-ops and the config checks of them, without torch
(the CLI, the router and `pdserve up` validate them without importing it); runtime/device.py and engine/attn_ops.py give them meaning."""

from __future__ import annotations

from ..choices import AttentionOps, Device, values

DEVICES = values(Device)
ATTENTION_OPS = values(AttentionOps)


def _one_of(flag: str, allowed: tuple[str, ...], name: str) -> str:
    if name not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {name!r}")
    return name


def check_device(name: str) -> str:
    return _one_of("--device", DEVICES, name)


def check_attention_ops(name: str) -> str:
    return _one_of("--attention-ops", ATTENTION_OPS, name)


def parse_gpu_ids(text: str | None) -> tuple[int, ...]:
    """ "0,1,3" -> (0, 1, 3); None or "" -> () (the default: rank r uses GPU r)."""
    if not text:
        return ()
    try:
        ids = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise ValueError(f"--gpu-ids must be comma-separated GPU ordinals, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"--gpu-ids must be non-negative, got {text!r}")
    return ids


def check_gpu_ids(gpu_ids) -> tuple[int, ...]:
    """gpu_ids as a config holds them: a tuple of GPU ordinals (parse_gpu_ids reads --gpu-ids)."""
    if not (isinstance(gpu_ids, tuple) and all(isinstance(i, int) and i >= 0 for i in gpu_ids)):
        raise ValueError(
            f"gpu_ids must be a tuple of GPU ordinals (parse_gpu_ids reads --gpu-ids), got {gpu_ids!r}"
        )
    return gpu_ids


def default_dtype(device: str) -> str:
    """bfloat16 on cuda, float32 on cpu (an explicit --dtype always wins)."""
    return "bfloat16" if device == "cuda" else "float32"


def check_device_fields(cfg, world_size: int) -> None:
    """__post_init__ of a server config with `device`, `gpu_ids`, `attention_ops` and `dtype`:
    validates them (gpu_ids a tuple of ordinals: the CLI parses --gpu-ids; dtype given: the config's
    `create` fills the device's default). Whether the GPUs exist is checked when the instance is
    built (LaunchConfig), so a config can be written (and --check-config printed) on a machine
    without them."""
    check_device(cfg.device)
    gpu_ids = check_gpu_ids(cfg.gpu_ids)
    if gpu_ids and cfg.device != "cuda":
        raise ValueError("--gpu-ids needs --device cuda")
    if gpu_ids and len(gpu_ids) != world_size:
        raise ValueError(f"--gpu-ids lists {len(gpu_ids)} GPU(s) for {world_size} rank(s): give one per rank")
    if not cfg.dtype:
        raise ValueError("dtype is empty: give one, or build the config with create() (the device's default)")
    check_attention_ops(cfg.attention_ops)
