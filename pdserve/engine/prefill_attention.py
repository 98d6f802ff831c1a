"""Attention for many queries of one request over its cached context, in query blocks.

Shared by the single-rank backend (contiguous query positions) and the prefill context-parallel
backend (each rank's own, non-contiguous positions). Memory is block x context, never
context x context.
"""

from __future__ import annotations

import torch

from ..model.backend import IndexerInputs
from ..model.config import ModelConfig
from ..model.kernels import index_scores
from .attn_ops import TorchOps

# Bytes of float32 scores one query block may materialise ([block, heads, context]). Two ranks on
# one socket share the last-level cache; blocks that overflow it cost up to 25% at 16k tokens.
SCORE_BUDGET = 32 << 20
# Bytes of selected keys a sparse layer attends over per call on the CPU: where they are gathered
# first (torch's ops) they are still in the last-level cache when attend reads them. Gathering a
# whole 256-query block (42 MB on the small model) and then attending ran 4-5x slower than
# sub-blocks of this size (32 queries there).
GATHER_BUDGET = 4 << 20


def block_size(cfg: ModelConfig, heads: int, context: int, query_block: int) -> int:
    """Queries per block: at most query_block, fewer at long context, at least 16."""
    scored_heads = cfg.index_n_heads if cfg.is_sparse else heads
    return max(16, min(query_block, SCORE_BUDGET // max(1, scored_heads * context * 4)))


def prefill_attention(
    cfg: ModelConfig,
    keys: torch.Tensor,  # [S, c + rope]: entries of positions 0..S-1
    idx_keys: torch.Tensor | None,  # [S, Di]: index keys (layers that run the indexer)
    q: torch.Tensor,  # [n, H, c + rope]
    q_pos: torch.Tensor,  # [n] ascending positions of the queries
    index: IndexerInputs | None,  # the queries' indexer inputs, None in shared / dense layers
    prev_selection: torch.Tensor | None,  # [n, k]: a shared layer reuses the last full layer's
    scale: float,
    query_block: int,
    ops=None,  # engine/attn_ops.py; None: the torch ops
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out [n, H, c], this layer's top-k selection [n, k] or None for dense models)."""
    ops = ops or TorchOps()
    if q.shape[0] == 0:  # a context-parallel rank may own no token of a short chunk
        k = cfg.index_topk if cfg.is_sparse else 0
        return q.new_zeros(0, q.shape[1], cfg.kv_lora_rank), (
            torch.zeros(0, k, dtype=torch.int64, device=q.device) if k else None
        )
    key_pos = torch.arange(keys.shape[0], device=q.device)
    outs, sels = [], []
    step = block_size(cfg, q.shape[1], keys.shape[0], query_block)
    for b0 in range(0, q.shape[0], step):
        b1 = min(q.shape[0], b0 + step)
        pos = q_pos[b0:b1]
        kend = int(pos.max()) + 1  # keys beyond the block's last query are never read
        valid = key_pos[None, :kend] <= pos[:, None]  # [B, kend] causal
        if not cfg.is_sparse:
            o, _ = ops.attend(q[b0:b1], keys[:kend], valid, scale, cfg.kv_lora_rank)
        else:
            if index is not None:
                scores = index_scores(
                    index.q[b0:b1], index.weights[b0:b1], idx_keys[:kend], index.softmax_scale
                )
                sel = ops.topk(scores, valid, cfg.index_topk)  # [B, k], -1 padded
            else:
                sel = prev_selection[b0:b1]
            sels.append(sel)
            o = _sparse_attend(ops, q[b0:b1], keys, sel, scale, cfg.kv_lora_rank)
        outs.append(o)
    return torch.cat(outs), (torch.cat(sels) if sels else None)


def _sparse_attend(ops, q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor, scale: float, dv: int):
    """Each query over its selected keys (sel [n, k], -1 padded), GATHER_BUDGET bytes of them at a
    time on the CPU (one call elsewhere): where torch's ops gather them (float64), the gathered keys
    are still in cache when attend reads them; the native kernel reads them in place (float32).
    Queries are independent: the sub-blocks change nothing but where the keys live when read."""
    n, row_bytes = q.shape[0], sel.shape[1] * keys.shape[1] * keys.element_size()
    step = n if keys.device.type != "cpu" else max(1, GATHER_BUDGET // max(1, row_bytes))
    outs = []
    for i in range(0, n, step):
        s = sel[i : i + step]
        outs.append(ops.attend_rows(q[i : i + step], keys, s, scale, dv)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs)
