"""engine/prefill_attention.py: a sparse layer gathers each query's selected keys GATHER_BUDGET
bytes at a time on the CPU. Queries are independent, so any sub-block size gives the same output as
one gather of the whole block: checked in float64 against a naive softmax over each query's keys."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.presets import hf_config
from pdserve.engine import prefill_attention as pa
from pdserve.model.config import ModelConfig


def naive(q, keys, sel, scale, dv):
    out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=q.dtype)
    for i, row in enumerate(sel.tolist()):
        picked = keys[[j for j in row if j >= 0]]
        p = torch.softmax(q[i] @ picked.t() * scale, dim=-1)
        out[i] = p @ picked[:, :dv]
    return out


@pytest.mark.parametrize("budget", [1, 3 * 8 * 20 * 8, 1 << 30])  # one query, three, the whole block
def test_sub_blocks_give_the_same_output(monkeypatch, budget):
    g = torch.Generator().manual_seed(0)
    n, heads, dim, dv, k, S = 37, 4, 20, 16, 8, 50
    q = torch.randn(n, heads, dim, generator=g, dtype=torch.float64)
    keys = torch.randn(S, dim, generator=g, dtype=torch.float64)
    sel = torch.stack([torch.randperm(S, generator=g)[:k].sort().values for _ in range(n)])
    sel[3, 5:] = -1  # a query with fewer than k keys
    monkeypatch.setattr(pa, "GATHER_BUDGET", budget)
    out = pa._sparse_attend(pa.TorchOps(), q, keys, sel, 0.3, dv)
    torch.testing.assert_close(out, naive(q, keys, sel, 0.3, dv), rtol=1e-12, atol=1e-12)


def test_prefill_attention_is_independent_of_the_gather_budget(monkeypatch):
    cfg = ModelConfig.from_dict(hf_config("glm_moe_dsa", "tiny"))
    g = torch.Generator().manual_seed(1)
    S, heads = 40, cfg.num_heads
    keys = torch.randn(S, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g, dtype=torch.float64)
    q = torch.randn(S, heads, keys.shape[1], generator=g, dtype=torch.float64)
    pos = torch.arange(S)
    sel = torch.stack(
        [
            torch.cat(
                [torch.arange(min(p + 1, cfg.index_topk)), torch.full((max(0, cfg.index_topk - p - 1),), -1)]
            )
            for p in range(S)
        ]
    )
    outs = []
    for budget in (1, 1 << 30):
        monkeypatch.setattr(pa, "GATHER_BUDGET", budget)
        out, _ = pa.prefill_attention(cfg, keys, None, q, pos, None, sel, 0.2, 16)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-13, atol=1e-13)
