"""Attention math as plain functions over tensors: no cache, no ranks.

MLA in absorbed form: a query is [H, kv_lora + rope] (q_nope already multiplied by W_UK), a key is
the cached latent entry [kv_lora + rope], and the value is the first kv_lora values of that entry.
Every attention function returns (out, lse) so that partial results over disjoint key sets can be
merged exactly (decode context parallelism); lse is -inf where a query saw no key, and then out is
exactly zero.
"""

from __future__ import annotations

import torch

from .. import env
from ..native import ops as native

FEW_ROWS = 8  # products of at most this many rows (a decode step's) stay off oneDNN's many-row path
# oneDNN's float32 product (what inductor calls on the CPU) against this torch's BLAS (MKL) on this
# machine's AMD EPYC: 2.2x the matmul rate for many rows (2048 x 512 x 1408: 509 vs 220 GFLOP/s);
# prefill of 2048 tokens 0.77 -> 0.64 s, 8192 tokens 4.07 -> 3.42 s on the small model. It is
# opt-in (PDSERVE_ONEDNN=1) because of its memory: with it glibc's heap grows erratically in a long
# prefill (peak RSS at 32768 tokens 1.2-6.9 GB instead of 0.4 GB; malloc_trim after every chunk does
# not bound it), which a long-context server cannot afford. Where the memory goes (2026-12-02): one
# oneDNN primitive per product shape, each holding its own scratch; the indexer's scores in a long
# prefill are a new shape for every query block ([256, 64] x [S, 64]^T with S growing by 32): 1024
# such shapes called in a loop took the process to 15 GB RSS, the same loop with S rounded up to a
# multiple of 1024 (32 shapes) to 0.9 GB, one shape to 0.3 GB. For a few rows (decode) it is no faster
# (6.2 vs 6.0 ms per step on the small model, batch 1) and costs more per call (15 vs 3 us).
ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN = ONEDNN_AVAILABLE and env.ONEDNN.on()
# One row times a large W (a decode step at batch 1 reading its weights) is another matter (where the
# native few-row kernel of native/ops.py is built it takes these products, faster still): there
# oneDNN streams W 1.0-1.9x faster than the BLAS's matrix-matrix path that `linear` takes otherwise
# (a one-off sweep on 2026-12-01, 2 threads: 1.5-1.9x for W of 1024-2048 x 1024-2048, 1.0-1.3x for
# 2048 x 512 and 3072 x 768, 0.7-1.0x below 4 MiB), its ~15 us call is small beside a read of
# 4 MiB, and a one-row product leaves nothing on the heap. On by default; PDSERVE_ONEDNN_GEMV=0
# turns it off. Rerun the end-to-end effect with PDSERVE_ONEDNN_GEMV=0 and =1 in front of
# `bench/engine.py --lengths 1024 --decode-batches 1 --skip-transformers` (medium preset: 104.7 vs
# 85.7 ms per step in one such pair of runs).
GEMV_MIN_BYTES = 4 << 20
ONEDNN_GEMV = ONEDNN_AVAILABLE and env.ONEDNN_GEMV.on()


def _float32_cpu(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device.type == "cpu" and a.dtype == b.dtype == torch.float32


def uses_onednn(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a [..., K] x b [N, K]^T goes to oneDNN: float32 on the CPU, more than FEW_ROWS rows."""
    return ONEDNN and _float32_cpu(a, b) and a.dim() >= 2 and a.numel() > FEW_ROWS * a.shape[-1]


def uses_onednn_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [1, K] x weight [N, K]^T goes to oneDNN: float32 on the CPU, W of GEMV_MIN_BYTES or more."""
    return (
        ONEDNN_GEMV
        and _float32_cpu(x, weight)
        and x.shape[:1] == (1,)
        and x.dim() == weight.dim() == 2
        and weight.numel() * 4 >= GEMV_MIN_BYTES
    )


def onednn_linear(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [..., K] x b [N, K]^T (+ bias) -> [..., N] by oneDNN's matmul on plain (unpacked) tensors."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [None], "")


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] x b [N, K]^T -> [..., N]: oneDNN where `uses_onednn`, torch.matmul otherwise."""
    return onednn_linear(a, b) if uses_onednn(a, b) else torch.matmul(a, b.t())


def take_rows(table: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """table[rows] for an index tensor of any shape, as one index_select: on the CPU about 3x faster
    than advanced indexing for the few hundred rows of a decode step or a query block. A slice
    stays a slice (a view)."""
    if not isinstance(rows, torch.Tensor):
        return table[rows]
    return table.index_select(0, rows.reshape(-1)).view(*rows.shape, *table.shape[1:])


def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [T, H, nope] times W_UK [H, nope, c] per head -> [T, H, c]: MLA's absorbed query.
    A decode step's few rows take the native kernel on the CPU (native/ops.py), else torch.matmul."""
    if native.heads_usable(q_nope, w_uk, 1):
        return native.heads_axpy(q_nope, w_uk)
    return torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def absorb_o(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [T, H, c] times W_UV [H, v, c]^T per head -> [T, H, v]: the latent output mapped to
    values, as `absorb_q` routes it."""
    if native.heads_usable(o_lat, w_uv, 2):
        return native.heads_linear(o_lat, w_uv)
    return torch.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of B queries over S keys each.

    q [B, H, D]; keys [S, D] (shared by all queries) or [B, S, D] (per query); valid [B, S] bool.
    Returns out [B, H, dv] (values are keys[..., :dv]) in q's dtype and lse [B, H] (natural log of
    the scaled scores) in the compute dtype. Half-precision inputs are computed in float32, as
    attention kernels accumulate. A decode step's float32 queries on the CPU take the native kernel
    (native/ops.py: one pass, no [B, H, S] temporaries), everything else torch's ops.
    """
    if native.attend_usable(q, keys, valid, dv):
        return native.attend(q, keys, valid, scale, dv)
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, keys = q.to(compute), keys.to(compute)
    scores = matmul_nt(q, keys) if keys.dim() == 2 else torch.matmul(q, keys.transpose(1, 2))  # [B, H, S]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))  # [B, H, S]
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe_lse[..., None])  # exp(-inf) = 0 for masked keys
    values = keys[..., :dv]
    # [B, H, dv]: values [S, dv] shared or [B, S, dv] per query
    out = matmul_nt(probs, values.t()) if values.dim() == 2 else torch.matmul(probs, values)
    return out.to(out_dtype), lse


def attend_rows(
    q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` of each query over rows of a table (a layer's KV cache): rows [B, S] int64, -1 where
    a query has no key. The native kernel reads the rows where they are (float32 CPU, a decode batch
    or a sparse prefill's sub-block), torch gathers them first."""
    if native.attend_rows_usable(q, table, rows, dv):
        return native.attend_rows(q, table, rows, scale, dv)
    return attend(q, take_rows(table, rows.clamp(min=0)), rows >= 0, scale, dv)


def merge_attention(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of N partial results over disjoint key sets (log-sum-exp rule).

    outs [N, ..., dv], lses [N, ...] -> (out [..., dv], lse [...]).
    out = sum_i exp(lse_i - logsumexp(lse)) * out_i; a part with lse -inf contributes exactly 0,
    and if every part is -inf the result is 0 with lse -inf (never NaN).
    """
    total = torch.logsumexp(lses, dim=0)  # [...]
    safe_total = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    weights = torch.exp(lses - safe_total.unsqueeze(0)).unsqueeze(-1).to(outs.dtype)  # exp(-inf - x) = 0
    # a part that saw no key may carry anything (even NaN) in its output: it must add exactly 0
    contrib = torch.where(weights > 0, weights * outs, torch.zeros_like(outs))
    return contrib.sum(dim=0), total


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """DSA indexer scores, computed in w's dtype (float32 like the reference, or float64).

    q [B, Hi, Di] (roped index queries), w [B, Hi] (per-head weights, already scaled by Hi^-0.5),
    keys [S, Di] shared or [B, S, Di] per query. Returns [B, S] = sum_h w_h * relu(scale * q_h . k).
    A decode step's float32 queries on the CPU take the native kernel (native/ops.py).
    """
    if native.index_scores_usable(q, w, keys):
        return native.index_scores(q, w, keys, softmax_scale)
    qf, kf = q.to(w.dtype), keys.to(w.dtype)
    s = matmul_nt(qf, kf) if keys.dim() == 2 else torch.matmul(qf, kf.transpose(1, 2))  # [B, Hi, S]
    s.mul_(softmax_scale).relu_()  # in place: at long context this tensor is the largest temporary
    return torch.matmul(w.unsqueeze(1), s).squeeze(1)  # [B, S]


def topk_earliest(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k per row with the tie rule of docs/design.md invariant 3: among equal scores the earlier
    (lower index) key wins. Invalid keys are never selected.

    scores [B, S] float, valid [B, S] bool -> indices [B, k] in ascending order, -1 where a row has
    fewer than k valid keys. float32 scores on the CPU take the native kernel (native/ops.py: a
    quickselect per row), unless a valid score is NaN.
    """
    B, S = scores.shape
    if k <= 0 or S == 0:
        return torch.full((B, max(k, 0)), -1, dtype=torch.int64, device=scores.device)
    if native.topk_usable(scores, valid, k) and (idx := native.topk_earliest(scores, valid, k)) is not None:
        return idx
    s = scores.masked_fill(~valid, float("-inf"))
    kk = min(k, S)
    kth = s.topk(kk, dim=-1).values[:, -1:]  # [B, 1]: the k-th largest score
    # No shortcut when no tie crosses the k-th place (topk's own set would do): telling would read a
    # value on the host, and a decode step must not (runtime/sync_check.py); the rule below gives
    # that set then too.
    n_valid = valid.sum(dim=-1, keepdim=True)  # [B, 1]
    above = s > kth
    tied = (s == kth) & valid
    need = kk - above.sum(dim=-1, keepdim=True)  # how many tied keys still fit
    chosen = above | (tied & (torch.cumsum(tied, dim=-1) <= need))
    # rows with fewer than k valid keys take every valid key
    chosen = torch.where(n_valid <= kk, valid, chosen)
    return _ascending_indices(chosen, k)


def _ascending_indices(chosen: torch.Tensor, k: int) -> torch.Tensor:
    """chosen [B, S] bool with at most k per row -> [B, k] ascending indices padded with -1."""
    B, S = chosen.shape
    pos = torch.arange(S, dtype=torch.int64, device=chosen.device).expand(B, S)
    keyed = torch.where(chosen, pos, torch.full_like(pos, S))  # unchosen sort to the end
    idx = keyed.topk(min(k, S), dim=-1, largest=False, sorted=True).values
    if idx.shape[1] < k:
        idx = torch.cat([idx, idx.new_full((B, k - idx.shape[1]), S)], dim=1)
    return torch.where(idx >= S, torch.full_like(idx, -1), idx)
