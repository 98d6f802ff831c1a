"""How many tokens a decode rank can hold: docs/design.md invariant 6.

With decode context parallelism over C_d ranks, slot s lives on rank s % C_d, so each rank keeps
1/C_d of the latent cache (E bytes per token over all layers). The index (I bytes per token over the
indexer layers) is either copied to every rank, so each rank scores every token by itself, or split
like the cache, which needs one more collective per indexer layer to merge top-k candidates. Per rank:

    copy:  E / C_d + I          split:  (E + I) / C_d

and the capacity factor over plain TP (C_d = 1) is (E + I) / per-rank bytes. Pure arithmetic: no
torch needed (a torch.dtype is accepted for model_dtype through its `itemsize`).
"""

from __future__ import annotations

from typing import Any

from ..choices import DcpIndex, KVCacheDType, values

KV_CACHE_DTYPES = values(KVCacheDType)
INDEX_MODES = values(DcpIndex)
FP8_SCALE_BYTES = 4  # one float32 scale per index key (per token and indexer layer)
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} (allowed: {', '.join(KV_CACHE_DTYPES)})")
    return kv_cache_dtype


def check_index_mode(index_mode: str) -> str:
    if index_mode not in INDEX_MODES:
        raise ValueError(f"unknown index_mode {index_mode!r} (allowed: {', '.join(INDEX_MODES)})")
    return index_mode


def dtype_bytes(dtype: Any) -> int:
    """Bytes per value of a model dtype given as a name ("bfloat16") or a torch.dtype."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r} (allowed: {', '.join(_DTYPE_BYTES)})")
        return _DTYPE_BYTES[name]
    return int(dtype.itemsize)


def _cache_value_bytes(kv_cache_dtype: str, model_dtype: Any) -> int:
    return 1 if check_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3" else dtype_bytes(model_dtype)


def entry_bytes(cfg, kv_cache_dtype: str = "auto", model_dtype: Any = "bfloat16") -> int:
    """E: latent cache bytes per token over all layers."""
    return cfg.num_layers * cfg.kv_entry_dim * _cache_value_bytes(kv_cache_dtype, model_dtype)


def index_bytes(cfg, kv_cache_dtype: str = "auto", model_dtype: Any = "bfloat16") -> int:
    """I: index-key bytes per token over the indexer layers (0 for dense models such as deepseek_v3).

    fp8 keys carry a per-key float32 scale, so each costs index_head_dim + 4 bytes (132 for 128)."""
    per_key = cfg.index_head_dim * _cache_value_bytes(kv_cache_dtype, model_dtype)
    if kv_cache_dtype == "fp8_e4m3":
        per_key += FP8_SCALE_BYTES
    return len(cfg.indexer_layers) * per_key


def bytes_per_token_per_rank(
    cfg,
    dcp_size: int = 1,
    index_mode: str = "copy",
    kv_cache_dtype: str = "auto",
    model_dtype: Any = "bfloat16",
) -> float:
    """Average bytes one decode rank spends per token of the instance."""
    _check_dcp(dcp_size)
    e, i = entry_bytes(cfg, kv_cache_dtype, model_dtype), index_bytes(cfg, kv_cache_dtype, model_dtype)
    return e / dcp_size + i if check_index_mode(index_mode) == "copy" else (e + i) / dcp_size


def capacity_factor(
    cfg,
    dcp_size: int = 1,
    index_mode: str = "copy",
    kv_cache_dtype: str = "auto",
    model_dtype: Any = "bfloat16",
) -> float:
    """Tokens held relative to plain TP (C_d = 1, every rank keeps everything)."""
    whole = entry_bytes(cfg, kv_cache_dtype, model_dtype) + index_bytes(cfg, kv_cache_dtype, model_dtype)
    return whole / bytes_per_token_per_rank(cfg, dcp_size, index_mode, kv_cache_dtype, model_dtype)


def page_bytes_per_rank(
    cfg,
    dcp_size: int,
    index_mode: str,
    page_size: int,
    kv_cache_dtype: str = "auto",
    model_dtype: Any = "bfloat16",
) -> int:
    """Exact bytes one rank spends on one page: page_size / C_d latent rows, plus page_size index rows
    (copy) or page_size / C_d (split). Pages are C_d-wide and C_d-aligned (invariant 4), so each rank
    gets the same whole number of rows and the budget arithmetic stays in integers."""
    _check_dcp(dcp_size)
    if page_size < 1 or page_size % dcp_size:
        raise ValueError(f"page_size {page_size} must be a positive multiple of dcp_size {dcp_size}")
    rows = page_size // dcp_size
    index_rows = page_size if check_index_mode(index_mode) == "copy" else rows
    return rows * entry_bytes(cfg, kv_cache_dtype, model_dtype) + index_rows * index_bytes(
        cfg, kv_cache_dtype, model_dtype
    )


def tokens_for_budget(
    cfg,
    budget_bytes: int,
    dcp_size: int = 1,
    index_mode: str = "copy",
    page_size: int = 64,
    kv_cache_dtype: str = "auto",
    model_dtype: Any = "bfloat16",
) -> int:
    """Token slots a decode instance gets when each rank may spend budget_bytes (whole pages only)."""
    page = page_bytes_per_rank(cfg, dcp_size, index_mode, page_size, kv_cache_dtype, model_dtype)
    return max(int(budget_bytes), 0) // page * page_size


def _check_dcp(dcp_size: int) -> None:
    if dcp_size < 1:
        raise ValueError(f"dcp_size must be >= 1, got {dcp_size}")
