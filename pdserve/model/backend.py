"""The contract between the model and whatever owns the KV cache.

The model computes projections; the backend it is handed stores the new latent entries (and index
keys), selects the keys each query may read (causal, or the indexer's top-k), and runs the kernel.
Single-rank, prefill context-parallel and decode context-parallel backends implement the same
method, so the model never knows about ranks, pages or collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class IndexerInputs:
    """What a layer that runs the DSA indexer hands to the backend for its new tokens."""

    q: torch.Tensor  # [T, Hi, Di] roped index queries
    k: torch.Tensor  # [T, Di] roped, normed index keys (these get cached)
    weights: torch.Tensor  # [T, Hi] per-head weights scaled by Hi^-0.5; their dtype is the score dtype
    softmax_scale: float  # Di^-0.5


class AttentionBackend(Protocol):
    def attention(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, kv_lora + rope]: absorbed q_nope, then roped q_pe
        kv: torch.Tensor,  # [T, kv_lora + rope]: the new tokens' latent cache entries
        index: IndexerInputs | None,  # present in layers that run the indexer
        scale: float,
    ) -> torch.Tensor:  # [T, H, kv_lora]: attention output in latent space
        ...
