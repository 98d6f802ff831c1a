"""The kernel layer below the attention backends: which implementation runs the attention math.

Every backend (single-rank, prefill CP, decode DCP) calls three ops through an `AttentionOps`:
  attend(q [B, H, D], keys [S, D] or [B, S, D], valid [B, S], scale, dv) -> (out [B, H, dv],
        lse [B, H] natural log, -inf where a row saw no key and then out is 0)
  attend_rows(q, table [N, D], rows [B, S] int64 (-1: no key), scale, dv): attend over table[rows]
        (the torch ops read the rows in place on the CPU; `attend_cached` below picks it for a pool)
  topk(scores [B, S], valid [B, S], k) -> [B, k] ascending indices, -1 padded, ties: the earlier key
        (docs/design.md invariant 3)
  merge(outs [N, ..., dv], lses [N, ...]) -> exact log-sum-exp merge
Three implementations: `torch` (model/kernels.py, CPU and CUDA, any dtype), `flashinfer`
(engine/attn_flashinfer.py, the only module that imports flashinfer: BatchMLAPagedAttentionWrapper
with page size 1, fa3 on Hopper, fa2 elsewhere, and flashinfer.top_k) and `triton` (attention by
model/triton_mla_decode.py, which reads an fp8 cache as stored and accumulates in float32; top-k and
merge are torch's). `select_attention_ops` is a pure function of (device, capability, installed
flashinfer and triton, dtype, MLA dims, KV cache dtype), so its table is tested on CPU; an explicit
`--attention-ops flashinfer` or `triton` where it cannot run is a startup error. `auto` picks
flashinfer where it runs; on cuda with an fp8 cache, which flashinfer does not take, triton, and
where neither runs it is an error: the torch ops would convert the whole cache to float32 (a
float32 fallback), which only an explicit `--attention-ops torch` asks for.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass

import torch

from ..model.kernels import attend, attend_rows, index_scores, merge_attention, topk_earliest
from ..native import ops as native
from ..runtime.placement import check_attention_ops

INDEX_CHUNK_BYTES = 64 << 20  # cached_index_scores: the float32 keys converted at a time
FLASHINFER_VERSION = "0.7.4"  # pyproject.toml's `cuda` extra pins the same; its API changes between minors
FLASHINFER_DTYPES = ("bfloat16", "float16")
FLASHINFER_DIMS = (512, 64)  # kv_lora_rank, rope head dim: what the MLA kernels are compiled for
TRITON_DTYPES = ("bfloat16", "float16", "float32")
FP8_CAPABILITY = (8, 9)  # triton converts e4m3 (fp8e4nv) tiles on Ada / Hopper and newer


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
    triton: str | None = None  # installed triton version, None when absent


@dataclass(frozen=True)
class OpsChoice:
    name: str  # "torch" | "flashinfer" | "triton"
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


def triton_blocker(f: OpsFacts) -> str | None:
    """Why the triton ops cannot run with these facts, or None when they can."""
    if f.device != "cuda":
        return f"triton needs --device cuda (device is {f.device})"
    if f.triton is None:
        return "triton is not installed"
    if f.capability is None or f.capability < (8, 0):
        return f"the triton MLA decode needs compute capability 8.0 or newer, this GPU has {f.capability}"
    if f.kv_cache_dtype == "fp8_e4m3" and f.capability < FP8_CAPABILITY:
        return f"triton reads an fp8 cache on compute capability 8.9 or newer, this GPU has {f.capability}"
    if f.dtype not in TRITON_DTYPES:
        return f"the triton MLA decode runs {', '.join(TRITON_DTYPES)}, not {f.dtype}"
    return None


def select_attention_ops(requested: str, facts: OpsFacts) -> OpsChoice:
    """The ops to use; ValueError when `flashinfer` or `triton` was asked for and cannot run, or when
    `auto` finds no kernel for an fp8 cache on cuda (never a silent fallback; module docstring)."""
    check_attention_ops(requested)
    if requested == "torch":
        return OpsChoice("torch", None, "--attention-ops torch")
    if requested == "triton":
        if (blocker := triton_blocker(facts)) is not None:
            raise ValueError(f"--attention-ops triton cannot run: {blocker}")
        return OpsChoice("triton", None, f"--attention-ops triton: triton {facts.triton}")
    blocker = flashinfer_blocker(facts)
    if blocker is None:
        backend = "fa3" if facts.capability[0] == 9 else "fa2"
        return OpsChoice("flashinfer", backend, f"{requested}: flashinfer {facts.flashinfer} {backend}")
    if requested == "flashinfer":
        raise ValueError(f"--attention-ops flashinfer cannot run: {blocker}")
    if facts.device == "cuda" and facts.kv_cache_dtype == "fp8_e4m3":
        if (no_triton := triton_blocker(facts)) is None:
            return OpsChoice("triton", None, f"auto: fp8 KV cache, triton {facts.triton} ({blocker})")
        raise ValueError(
            f"--attention-ops auto cannot run an fp8 KV cache on cuda: {blocker}; {no_triton} "
            "(--attention-ops torch runs the float32 reference, --kv-cache-dtype auto the model dtype)"
        )
    return OpsChoice("torch", None, f"auto: {blocker}")


def installed(package: str) -> str | None:
    """The installed version of a package, read from its metadata (no import: flashinfer's is slow
    and initialises CUDA)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gather_facts(device: torch.device, dtype: torch.dtype, cfg, kv_cache_dtype: str = "auto") -> OpsFacts:
    """The facts of this process: device and its capability, installed packages, dtype and dims."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return OpsFacts(
        device.type,
        tuple(cap) if cap else None,
        installed("flashinfer-python"),
        str(dtype).removeprefix("torch."),
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        kv_cache_dtype,
        installed("triton"),
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


class TritonOps(TorchOps):
    """Attention by model/triton_mla_decode.py (imported at the first call: triton loads only where
    it was chosen); top-k and merge as TorchOps. `reads_fp8`: attend_cached hands it an fp8 table as
    stored, never a converted copy."""

    name = "triton"
    reads_fp8 = True

    def attend(self, q, keys, valid, scale: float, dv: int):
        """keys [S, D] shared or [B, S, D] per query, as rows of one table."""
        B, S = valid.shape
        cols = torch.arange(S, device=valid.device).expand(B, S)
        if keys.dim() == 3:
            cols = cols + torch.arange(B, device=valid.device)[:, None] * S
        return self.attend_rows(q, keys.reshape(-1, keys.shape[-1]), cols.masked_fill(~valid, -1), scale, dv)

    def attend_rows(self, q, table, rows, scale: float, dv: int, kv_scale: float = 1.0):
        from ..model.triton_mla_decode import mla_decode

        return mla_decode(q, table, rows, scale, dv, kv_scale)


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
    if choice.name == "triton":
        return TritonOps()
    from .attn_flashinfer import FlashinferOps

    return FlashinferOps(device, choice.backend)


def attend_cached(ops, pool, layer: int, q, slots, valid, scale: float, dv: int):
    """q [B, H, D] over the latent entries of pool slots [B, S] where valid [B, S]: read where they
    lie (ops.attend_rows) when the pool stores them as attention reads them or the ops read fp8
    (triton), else gathered and converted (pool.read_kv: fp8) first."""
    table = pool.kv_table(layer)
    stored = pool.fp8 and getattr(ops, "reads_fp8", False)  # the triton ops read fp8 rows as stored
    if table is None and not stored:
        return ops.attend(q, pool.read_kv(layer, slots), valid, scale, dv)
    rows = pool.kv_row_ids(slots).masked_fill(~valid, -1)
    if stored:
        return ops.attend_rows(q, pool.kv_stored(layer), rows, scale, dv, pool.kv_scale)
    return ops.attend_rows(q, table, rows, scale, dv)


def cached_index_scores(pool, layer: int, rows, index, chunk_bytes: int = INDEX_CHUNK_BYTES):
    """DSA indexer scores [B, S] (model/kernels.index_scores) of `index` over the index keys of pool
    rows [B, S] (a copied index's slots, a split one's own rows). Keys stored in the scores' dtype
    (the float32 / float64 model paths) are read and scored at once, exactly as before. Keys that
    must be converted (a bf16 or fp8 cache: index_scores computes in float32) are read, converted
    and scored a piece of columns at a time, at most chunk_bytes of float32 keys per piece, so no
    float32 copy of every key (nor the [B, heads, S] per-head scores of all of them) is made at once.
    The pieces depend only on the shapes: no host sync."""
    w, scale = index.weights, index.softmax_scale
    B, S = rows.shape
    width = max(B * pool.index_k.shape[-1] * 4, 1)  # float32 bytes per column of the batch
    step = max(chunk_bytes // width, 1)
    if (not pool.fp8 and pool.index_k.dtype == w.dtype) or S <= step:
        return index_scores(index.q, w, pool.read_index(layer, rows), scale)
    parts = [
        index_scores(index.q, w, pool.read_index(layer, rows[:, i : i + step]), scale)
        for i in range(0, S, step)
    ]
    return torch.cat(parts, dim=1)
