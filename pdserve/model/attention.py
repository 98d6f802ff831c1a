"""Multi-head latent attention (MLA) and the DeepSeek Sparse Attention indexer: projections only.

Everything that touches the cache (storing entries, choosing which keys a query reads, the
kernel, any collective) happens in the AttentionBackend the caller hands in. The module computes
the absorbed query q_nope @ W_UK so the backend attends directly over latent entries, and maps the
latent output back through W_UV.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .backend import AttentionBackend, IndexerInputs
from .config import ModelConfig
from .kernels import absorb_o, absorb_q
from .layers import LayerNorm, Linear, RMSNorm
from .rope import apply_rope


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = (
            cfg.index_n_heads,
            cfg.index_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.interleave = cfg.indexer_rope_interleave
        self.score_dtype = torch.float32 if cfg.float32_islands else torch.float64
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = Linear(cfg.hidden_size, self.head_dim)
        self.k_norm = LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)  # kept in float32, as the reference does

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        wk_x: torch.Tensor | None = None,
    ) -> IndexerInputs:
        """wk_x: wk(x) where the caller computed it (a stacked product), else None."""
        T = x.shape[0]
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)
        q_rot, q_pass = torch.split(q, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = self.k_norm(self.wk(x) if wk_x is None else wk_x)  # [T, Di]
        k_rot, k_pass = torch.split(k, [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q = torch.cat([apply_rope(q_rot, cos, sin, self.interleave), q_pass], dim=-1)
        k = torch.cat([apply_rope(k_rot, cos, sin, self.interleave), k_pass], dim=-1)
        wp = self.weights_proj.weight  # a float32 island: the reference's op, so the reference's sums
        w = F.linear(x.to(wp.dtype), wp).to(self.score_dtype) * self.n_heads**-0.5
        return IndexerInputs(q=q, k=k, weights=w, softmax_scale=self.head_dim**-0.5)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.rope_interleave = cfg.rope_interleave
        self.scale = cfg.softmax_scale
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, self.n_heads * qk)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, islands=cfg.float32_islands)
            self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * qk)
        self.kv_a_proj_with_mqa = Linear(
            cfg.hidden_size, cfg.kv_lora_rank + self.rope_dim, bias=cfg.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, islands=cfg.float32_islands)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer) else None
        # Heads whose output this module produces, among the n_heads whose queries it computes.
        # All of them on one rank; tensor parallelism narrows both from outside (decode_server/tp.py).
        self.out_heads = slice(0, self.n_heads)
        self.a_stack = None  # a fusion.RowStack of input_projections(), set after loading

    def input_projections(self) -> list[Linear]:
        """The projections that read the layer's input x: q_a (with a q LoRA), kv_a, the indexer's wk."""
        q_a = [self.q_a_proj] if hasattr(self, "q_a_proj") else []
        return q_a + [self.kv_a_proj_with_mqa] + ([self.indexer.wk] if self.indexer is not None else [])

    def _project_input(self, x: torch.Tensor):
        """(q_a(x) or None, kv_a(x), wk(x) or None): one stacked product while the stack is live;
        otherwise wk is left to the indexer."""
        has_q_a = hasattr(self, "q_a_proj")
        stack = self.a_stack
        if stack is None or not stack.live():
            return (self.q_a_proj(x) if has_q_a else None), self.kv_a_proj_with_mqa(x), None
        outs = stack(x)
        q_a = outs.pop(0) if has_q_a else None
        return q_a, outs[0], (outs[1] if len(outs) > 1 else None)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope, :], w[
            self.out_heads, self.nope :, :
        ]  # W_UK [H, nope, c], W_UV [H_out, v, c]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        T = x.shape[0]
        q_a, kv_a, wk_x = self._project_input(x)
        if q_a is None:
            q_resid, q = None, self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = torch.split(
            q.view(T, self.n_heads, self.nope + self.rope_dim), [self.nope, self.rope_dim], dim=-1
        )
        q_pe = apply_rope(q_pe, cos, sin, self.rope_interleave)
        c_kv, k_pe = torch.split(kv_a, [self.kv_lora, self.rope_dim], dim=-1)
        kv = torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_pe, cos, sin, self.rope_interleave)], dim=-1)
        w_uk, w_uv = self._absorb_weights()
        q_lat = torch.cat([absorb_q(q_nope, w_uk), q_pe], dim=-1)  # [T, H, c + rope]
        index = self.indexer(x, q_resid, cos, sin, wk_x) if self.indexer is not None else None
        o_lat = backend.attention(self.layer, q_lat, kv, index, self.scale)  # [T, H_out, c]
        o = absorb_o(o_lat, w_uv)  # [T, H_out, v]
        return self.o_proj(o.reshape(T, w_uv.shape[0] * self.v_dim))
