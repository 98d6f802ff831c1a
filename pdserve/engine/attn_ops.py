"""The kernel layer below the attention backends: which implementation runs the attention math.

Every backend (single-rank, prefill CP, decode DCP) calls three ops through an `AttentionOps`:
  attend(q [B, H, D], keys [S, D] or [B, S, D], valid [B, S], scale, dv) -> (out [B, H, dv],
        lse [B, H] natural log, -inf where a row saw no key and then out is 0)
  attend_rows(q, table [N, D], rows [B, S] int64 (-1: no key), scale, dv): attend over table[rows]
        (the torch ops read the rows in place on the CPU; `attend_cached` below picks it for a pool)
  topk(scores [B, S], valid [B, S], k) -> [B, k] ascending indices, -1 padded, ties: the earlier key
        (docs/design.md invariant 3)
  merge(outs [N, ..., dv], lses [N, ...]) -> exact log-sum-exp merge
Two implementations: `torch` (model/kernels.py, CPU and CUDA, any dtype) and `flashinfer`
(engine/attn_flashinfer.py, the only module that imports flashinfer: BatchMLAPagedAttentionWrapper
with page size 1, fa3 on Hopper, fa2 elsewhere, and flashinfer.top_k). `select_attention_ops` is a
pure function of (device, capability, installed flashinfer, dtype, MLA dims, KV cache dtype), so
its table is tested on CPU; `--attention-ops flashinfer` where it cannot run is a startup error.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass

import torch

from ..model import native
from ..model.kernels import attend, attend_rows, merge_attention, topk_earliest
from .placement import check_attention_ops

FLASHINFER_VERSION = "0.7.4"  # pyproject.toml's `cuda` extra pins the same; its API changes between minors
FLASHINFER_DTYPES = ("bfloat16", "float16")
FLASHINFER_DIMS = (512, 64)  # kv_lora_rank, rope head dim: what the MLA kernels are compiled for


@dataclass(frozen=True)
class OpsFacts:
    """Everything the choice depends on."""

    device: str  # "cpu" | "cuda"
    capability: tuple[int, int] | None  # CUDA compute capability of this rank's GPU
    flashinfer: str | None  # installed flashinfer-python version, None when absent
    dtype: str  # compute dtype name (e.g. "bfloat16")
    kv_lora_rank: int
    rope_dim: int
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class OpsChoice:
    name: str  # "torch" | "flashinfer"
    backend: str | None  # flashinfer MLA backend: "fa3" | "fa2"
    reason: str  # why (logged at startup)


def flashinfer_blocker(f: OpsFacts) -> str | None:
    """Why the flashinfer ops cannot run with these facts, or None when they can."""
    if f.device != "cuda":
        return f"flashinfer needs --device cuda (device is {f.device})"
    if f.flashinfer is None:
        return "flashinfer-python is not installed (pip install 'pdserve[cuda]')"
    if f.flashinfer != FLASHINFER_VERSION:
        return (
            f"flashinfer-python {f.flashinfer} is installed; pdserve is written against {FLASHINFER_VERSION}"
        )
    if f.capability is None or f.capability < (8, 0):
        return f"flashinfer MLA needs compute capability 8.0 or newer, this GPU has {f.capability}"
    if f.dtype not in FLASHINFER_DTYPES:
        return f"flashinfer MLA runs {' or '.join(FLASHINFER_DTYPES)}, not {f.dtype}"
    if (f.kv_lora_rank, f.rope_dim) != FLASHINFER_DIMS:
        return (
            f"flashinfer MLA kernels are built for kv_lora_rank {FLASHINFER_DIMS[0]} and rope dim "
            f"{FLASHINFER_DIMS[1]}; this model has {f.kv_lora_rank} and {f.rope_dim}"
        )
    if f.kv_cache_dtype != "auto":
        return f"--kv-cache-dtype {f.kv_cache_dtype} is not wired to the flashinfer ops yet"
    return None


def select_attention_ops(requested: str, facts: OpsFacts) -> OpsChoice:
    """The ops to use; ValueError when `flashinfer` was asked for and cannot run (never a silent fallback)."""
    check_attention_ops(requested)
    if requested == "torch":
        return OpsChoice("torch", None, "--attention-ops torch")
    blocker = flashinfer_blocker(facts)
    if blocker is None:
        backend = "fa3" if facts.capability[0] == 9 else "fa2"
        return OpsChoice("flashinfer", backend, f"{requested}: flashinfer {facts.flashinfer} {backend}")
    if requested == "flashinfer":
        raise ValueError(f"--attention-ops flashinfer cannot run: {blocker}")
    return OpsChoice("torch", None, f"auto: {blocker}")


def installed_flashinfer() -> str | None:
    """The installed flashinfer-python version, read from package metadata (no import: it is slow
    and initialises CUDA)."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def gather_facts(device: torch.device, dtype: torch.dtype, cfg, kv_cache_dtype: str = "auto") -> OpsFacts:
    """The facts of this process: device and its capability, installed packages, dtype and dims."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return OpsFacts(
        device.type,
        tuple(cap) if cap else None,
        installed_flashinfer(),
        str(dtype).removeprefix("torch."),
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        kv_cache_dtype,
    )


class TorchOps:
    """model/kernels.py: float32 (float64) accumulation, any device."""

    name = "torch"

    def attend(self, q, keys, valid, scale: float, dv: int):
        return attend(q, keys, valid, scale, dv)

    def attend_rows(self, q, table, rows, scale: float, dv: int):
        return attend_rows(q, table, rows, scale, dv)

    def topk(self, scores, valid, k: int):
        return topk_earliest(scores, valid, k)

    def merge(self, outs, lses):
        return merge_attention(outs, lses)


def make_attention_ops(
    requested: str, device: torch.device, dtype: torch.dtype, cfg, kv_cache_dtype: str = "auto", who: str = ""
):
    """The ops object of one rank (or engine). With `who` (a rank's or a command's name) the choice
    and its reason are printed to stderr: the startup line of the server's log."""
    choice = select_attention_ops(requested, gather_facts(device, dtype, cfg, kv_cache_dtype))
    if who:
        print(f"{who}: attention ops {choice.name} ({choice.reason})", file=sys.stderr, flush=True)
        if device.type == "cpu" and dtype == torch.float32:  # builds the kernel now, not in a request
            print(f"{who}: few-row products on {native.status()}", file=sys.stderr, flush=True)
    if choice.name == "torch":
        return TorchOps()
    from .attn_flashinfer import FlashinferOps

    return FlashinferOps(device, choice.backend)


def attend_cached(ops, pool, layer: int, q, slots, valid, scale: float, dv: int):
    """q [B, H, D] over the latent entries of pool slots [B, S] where valid [B, S]: read where they
    lie (ops.attend_rows) when the pool stores them as attention reads them, else gathered and
    converted (pool.read_kv: fp8) first."""
    table = pool.kv_table(layer)
    if table is None:
        return ops.attend(q, pool.read_kv(layer, slots), valid, scale, dv)
    return ops.attend_rows(q, table, pool.kv_row_ids(slots).masked_fill(~valid, -1), scale, dv)
