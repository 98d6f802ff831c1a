"""The decoder stack: embeddings, MLA + MLP/MoE layers, final norm and LM head.

Inputs are flattened tokens of any number of requests with their absolute positions; which tokens
belong to which request, and where their cache entries live, is the attention backend's business.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import MLAttention
from .backend import AttentionBackend
from .config import ModelConfig
from .layers import MLP, MoE, RMSNorm, empty_param, linear
from .rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer)
        self.mlp = (
            MoE(cfg)
            if cfg.mlp_layer_types[layer] == "sparse"
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.float32_islands)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.float32_islands)

    def forward(self, x, cos, sin, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """[vocab, hidden] rows: looked up by token id (embeddings) or multiplied by the hidden states
    (LM head, `logits`). A vocab-parallel rank holds a slice of the rows (model/shard.py `cut_rows`)."""

    cut = None  # model/shard.Cut: the rows of the checkpoint tensor this rank holds (None: all)

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = empty_param(vocab, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.float32_islands)
        self.rotary_emb = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(ids)  # [T, hidden]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [T, rope/2] each
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)


class CausalLM(nn.Module):
    """forward(ids [T], positions [T], backend) -> final hidden states [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] for the rows the caller needs."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = Embedding(cfg.vocab_size, cfg.hidden_size)  # [vocab, hidden]
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        return self.model(ids, positions, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)
