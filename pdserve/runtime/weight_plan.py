"""Bytes of weights per rank, and how many ranks a decode instance needs on a given GPU.

The model is built on the meta device (no memory, no checkpoint), and its parameters are sorted by
how the servers split them:
  - `heads`: q_proj / q_b_proj and kv_b_proj rows (one slice per head), o_proj columns: a decode
    rank keeps 1/W (its head slice; q and kv_b for the C_d slices of its group with
    --replicate-q-proj); a prefill rank keeps all of them;
  - `ffn`: dense MLP, routed and shared experts: 1/W on a decode rank (--moe-ep or not), 1/C_p on a
    prefill rank with --moe-tp, else all; `routed`, its routed experts' part: 1/C_p on a prefill
    rank with --moe-ep;
  - `vocab`: embeddings and LM head: 1/W on a decode rank (vocab-parallel), all on a prefill rank;
  - `replicated`: norms, kv_a / q_a projections, the indexer, the router.
This planner counts weights in the run dtype (an FP8 checkpoint dequantized, `--dequantize`); the few
parameters the reference keeps in float32 (indexer weights_proj, routing bias) count 4 bytes. The
exact bytes of a rank, fp8 kept, come from its meta model (check_plan.rank_weight_bytes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..kvcache import capacity

_HEADS = re.compile(r"self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.weight$")
_VOCAB = re.compile(r"^(model\.embed_tokens|lm_head)\.weight$")
_FFN = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj|experts\.|shared_experts\.)")


@dataclass(frozen=True)
class ParamBytes:
    """Bytes of each split class at the run dtype; `q` is the part of `heads` a replicated q projection
    copies, `routed` the part of `ffn` in routed experts."""

    heads: int
    q: int
    ffn: int
    replicated: int
    vocab: int = 0
    routed: int = 0

    @property
    def total(self) -> int:
        return self.heads + self.ffn + self.replicated + self.vocab

    def decode_rank(self, tp_size: int, dcp_size: int = 1, replicate_q: bool = False) -> int:
        q_copies = dcp_size if replicate_q else 1
        split = self.heads + self.q * (q_copies - 1) + self.ffn + self.vocab
        return -(-split // tp_size) + self.replicated  # an uneven vocab split: the larger share

    def prefill_rank(self, cp_size: int, moe_tp: bool = False, moe_ep: bool = False) -> int:
        if moe_tp:
            ffn = self.ffn // cp_size
        elif moe_ep:  # the shared experts and dense MLPs stay whole
            ffn = self.routed // cp_size + self.ffn - self.routed
        else:
            ffn = self.ffn
        return self.heads + ffn + self.replicated + self.vocab


def param_bytes(cfg, dtype) -> ParamBytes:
    """cfg: a ModelConfig; dtype: a name ("bfloat16") or torch.dtype."""
    import torch

    from ..model.shard import FP32_PARAM_PATTERNS
    from ..model.transformer import CausalLM

    value_bytes = capacity.dtype_bytes(dtype)
    with torch.device("meta"):
        model = CausalLM(cfg)
    sums = {"heads": 0, "q": 0, "ffn": 0, "replicated": 0, "vocab": 0, "routed": 0}
    for name, p in model.named_parameters():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        fp32 = cfg.float32_islands and any(pat.search(name) for pat in FP32_PARAM_PATTERNS)
        nbytes = p.numel() * (4 if fp32 else value_bytes)
        m = _HEADS.search(name)
        if m:
            sums["heads"] += nbytes
            sums["q"] += nbytes if m.group(1) in ("q_proj", "q_b_proj", "kv_b_proj") else 0
        elif _FFN.search(name):
            sums["ffn"] += nbytes
            sums["routed"] += nbytes if ".mlp.experts." in name else 0
        elif _VOCAB.match(name):
            sums["vocab"] += nbytes
        else:
            sums["replicated"] += nbytes
    return ParamBytes(**sums)


def ranks_to_hold(
    pb: ParamBytes, num_heads: int, gpu_memory: int, multiple_of: int = 1, replicate_q: bool = False
) -> int | None:
    """The fewest decode ranks W (a multiple of `multiple_of` that divides the heads) whose weights fit
    in gpu_memory per rank; None if no W does."""
    for w in range(multiple_of, num_heads + 1, multiple_of):
        if num_heads % w == 0 and pb.decode_rank(w, multiple_of, replicate_q) <= gpu_memory:
            return w
    return None


def gpu_plan(
    cfg, pb: ParamBytes, gpu_memory: int, dcp_sizes: list[int], page_size: int, kv_cache_dtype: str, dtype
) -> list[dict]:
    """Per C_d: the fewest ranks W that hold the weights, what is left for the KV cache per rank, and
    the KV tokens one decode instance then holds (copied and split index)."""
    rows = []
    for c in dcp_sizes:
        w = ranks_to_hold(pb, cfg.num_heads, gpu_memory, multiple_of=c)
        row: dict = {"dcp_size": c, "ranks": w}
        if w is not None:
            weights = pb.decode_rank(w, c)
            budget = gpu_memory - weights
            row.update(weight_bytes_per_rank=weights, kv_bytes_per_rank=budget)
            for mode in capacity.INDEX_MODES:
                row[f"tokens_{mode}"] = capacity.tokens_for_budget(
                    cfg, budget, c, mode, page_size, kv_cache_dtype, dtype
                )
        rows.append(row)
    return rows
