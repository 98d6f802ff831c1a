"""The names of --device, --gpu-ids and --attention-ops, without torch (the router and `pdserve up`
validate them without importing it); engine/device.py and engine/attn_ops.py give them meaning."""

from __future__ import annotations

DEVICES = ("cpu", "cuda")
ATTENTION_OPS = ("auto", "torch", "flashinfer")


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
