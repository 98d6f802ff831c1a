"""Does a rank fit its device? Its weights (by dtype), KV pool and a workspace against the device's
memory, checked on the meta-device model before anything is allocated, so a rank that cannot fit
refuses to start with the numbers instead of failing in the middle of a load.

Available memory: on cuda the device's free memory (torch.cuda.mem_get_info), on the CPU the host's
MemAvailable (/proc/meminfo). The workspace is an estimate of what a step allocates beside the
weights and the pool (activations, kernels' scratch, the CUDA context's share).

`--gpu-memory-utilization` (cuda, no explicit pool size): the pool takes what the weights and the
workspace leave of that share of the device (`kv_tokens_for_memory`, a pure function)."""

from __future__ import annotations

import math

WORKSPACE_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class RankMemoryError(ValueError):
    """A rank's weights + KV + workspace exceed its device's memory; the message names the numbers."""


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def available_bytes(device) -> tuple[int, str]:
    """(bytes free for this rank, where they are)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0], f"{device} has"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "the host has"
    raise RankMemoryError("cannot read MemAvailable from /proc/meminfo")


def check_rank_fits(
    who: str, weights: dict[str, int], kv_bytes: int, available: int, where: str, workspace: int
) -> None:
    need = sum(weights.values()) + kv_bytes + workspace
    if need <= available:
        return
    by_dtype = ", ".join(f"{d} {gib(n)}" for d, n in sorted(weights.items(), key=lambda kv: -kv[1]))
    raise RankMemoryError(
        f"{who} cannot start: it needs {gib(need)} (weights {gib(sum(weights.values()))}: {by_dtype}; "
        f"KV cache {gib(kv_bytes)}; workspace {gib(workspace)}) but {where} {gib(available)} free; "
        "use more ranks (--tp-size / --cp-size with --moe-tp), fewer KV slots, or fp8 weights "
        "(an fp8 checkpoint on cuda without --dequantize)"
    )


def check_device_fits(who: str, device, weights: dict[str, int], kv_bytes: int) -> None:
    """check_rank_fits against `device`'s free memory now."""
    available, where = available_bytes(device)
    check_rank_fits(who, weights, kv_bytes, available, where, WORKSPACE_BYTES.get(device.type, 0))


def check_gpu_memory_utilization(fraction: float) -> float:
    if not (isinstance(fraction, (int, float)) and math.isfinite(fraction) and 0 < fraction <= 1):
        raise ValueError(f"--gpu-memory-utilization must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def kv_tokens_for_memory(
    total: int, used: int, weights: int, workspace: int, utilization: float, page_bytes: int, page_size: int
) -> int:
    """KV tokens (whole pages) a rank gets from `utilization` of a device of `total` bytes of which
    `used` are already in use (this process's CUDA context, other processes), after its weights and
    workspace: floor((utilization * total - used - weights - workspace) / page_bytes) pages."""
    check_gpu_memory_utilization(utilization)
    if page_bytes < 1 or page_size < 1:
        raise ValueError(f"page_bytes {page_bytes} and page_size {page_size} must be positive")
    left = math.floor(utilization * total) - used - weights - workspace
    return max(left, 0) // page_bytes * page_size


def device_memory(device) -> tuple[int, int]:
    """(total, in use now) bytes of a cuda device."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total, total - free
