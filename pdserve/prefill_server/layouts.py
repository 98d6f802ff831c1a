"""Which prompt tokens each of the C context-parallel ranks of a prefill instance owns.

Every rank computes attention for its own queries only (the keys/values are all-gathered), and
with causal attention the query at position p reads p + 1 keys, so a late token costs more than
an early one. The layout decides how that triangle of work is shared:

  interleave  token p on rank p % C. Almost balanced (0.0055% above average at 128k tokens on 8
              ranks) but a rank's queries are C apart and each reads up to a different point, which
              only fits sparse attention, where every query carries its own top-k list anyway.
              The only layout for the sparse-attention models (glm_moe_dsa, deepseek_v32).
  zigzag      2C blocks, rank r owns block r and block 2C-1-r: a cheap block paired with an
              expensive one, exactly balanced, and each block is a consecutive run of queries that
              a regular (dense) causal kernel handles with one "reads end here" number. The
              recommended layout for dense-attention models (deepseek_v3).
  contiguous  C consecutive pieces; the last rank does ~2C-1 times the work of the first.
              Kept for comparison only.

Pure Python (no torch) so the CLI can validate flags without loading the model stack.
"""

from __future__ import annotations

from pdserve.choices import Layout, values  # torch-free module
from pdserve.model.config import SPARSE_MODEL_TYPES, SUPPORTED_MODEL_TYPES  # torch-free module

LAYOUTS = values(Layout)

# Layouts each model type may be served with; the first is the recommended one.
ALLOWED_LAYOUTS = {
    model_type: ("interleave",)
    if model_type in SPARSE_MODEL_TYPES
    else ("zigzag", "interleave", "contiguous")
    for model_type in SUPPORTED_MODEL_TYPES
}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown cp layout {layout!r}; allowed: {', '.join(LAYOUTS)}")


def _check_cp_size(cp_size: int) -> None:
    # bool is an int subclass; True would silently mean "1 rank".
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1 (1, 2, 3, ...), got {cp_size!r}")


def split_positions(layout: str, start: int, end: int, cp_size: int) -> list[list[int]]:
    """Absolute positions in [start, end) owned by each rank (one ascending list per rank).

    Positions < start are a cached prefix (or earlier chunks): they are read, never split.
    """
    _check_layout(layout)
    _check_cp_size(cp_size)
    if start < 0 or end < start:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    n = end - start
    if layout == "interleave":
        # Keyed on the absolute position, so a chunk starting anywhere keeps "token p on rank p % C"
        # (the same rule decode-side CP uses for the cache).
        return [list(range(start + (r - start) % cp_size, end, cp_size)) for r in range(cp_size)]
    if layout == "contiguous":
        return [list(range(start + r * n // cp_size, start + (r + 1) * n // cp_size)) for r in range(cp_size)]
    # zigzag: block b = [b*n // 2C, (b+1)*n // 2C) relative to the chunk; floor cuts cover every
    # token once even when 2C does not divide n (blocks differ by at most one token, some may be empty).
    nb = 2 * cp_size

    def block(b: int) -> list[int]:
        return list(range(start + b * n // nb, start + (b + 1) * n // nb))

    return [block(r) + block(nb - 1 - r) for r in range(cp_size)]


def pair_counts(layout: str, n: int, cp_size: int, start: int = 0) -> list[int]:
    """Causal query-key pairs per rank for the chunk [start, start + n): query p reads p + 1 keys
    (itself and everything before it, cached prefix included)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [sum(p + 1 for p in pos) for pos in split_positions(layout, start, start + n, cp_size)]


def balance(layout: str, n: int, cp_size: int) -> float:
    """Busiest rank's pairs / average pairs per rank (1.0 = perfect; the step waits for the busiest,
    since every layer's all-gather finishes with the slowest rank). 1.0 for an empty chunk."""
    counts = pair_counts(layout, n, cp_size)
    total = sum(counts)
    return 1.0 if total == 0 else max(counts) * cp_size / total


def zigzag_block_units(cp_size: int) -> list[float]:
    """Per-rank zigzag work in units of "one block of queries reading one block of keys".

    Block b reads the b blocks before it plus (about) half of itself: b + 1/2 units. Rank r owns
    blocks r and 2C-1-r: (r + 1/2) + (2C-1-r + 1/2) = 2C, independent of r. (The exact pair count
    of a block of s tokens is b*s^2 + s(s+1)/2; the r still cancels, giving 2C*s^2 + s per rank,
    so with 2C | n zigzag's exact pair counts are equal too.)
    """
    _check_cp_size(cp_size)
    return [(r + 0.5) + (2 * cp_size - 1 - r + 0.5) for r in range(cp_size)]


def check_layout_allowed(model_type: str, layout: str) -> None:
    """Raise ValueError unless `layout` may be used for `model_type`.

    Sparse-attention models only take interleave: their attention gathers a per-query top-k list,
    so consecutive query runs (zigzag's point) buy nothing, and (like SGLang, which rejects zigzag
    for DeepSeek-V3.2) the sparse CP path is only built for interleave. Dense models take all three.
    """
    _check_layout(layout)
    if model_type not in ALLOWED_LAYOUTS:
        raise ValueError(f"unknown model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    allowed = ALLOWED_LAYOUTS[model_type]
    if layout not in allowed:
        raise ValueError(
            f"--cp-layout {layout} is not supported for {model_type}: sparse-attention models need "
            f"interleave (each query carries its own top-k list; zigzag serves dense-attention models "
            f"such as deepseek_v3)"
        )


def recommended_layout(model_type: str) -> str:
    """Default --cp-layout: interleave for sparse-attention models, zigzag for dense ones."""
    if model_type not in ALLOWED_LAYOUTS:
        raise ValueError(f"unknown model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return ALLOWED_LAYOUTS[model_type][0]
