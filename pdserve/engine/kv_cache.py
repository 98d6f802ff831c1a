"""KV storage: the tensors that hold latent cache entries and index keys, addressed by slot.

Bookkeeping (which request owns which slots) lives in PageAllocator; this class only stores.
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig


class KVPool:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.num_slots = num_slots
        self.kv = torch.zeros(cfg.num_layers, num_slots, cfg.kv_entry_dim, dtype=dtype, device=device)  # [L, slots, c+rope]
        self.index_row = {layer: i for i, layer in enumerate(cfg.indexer_layers)}
        n_idx = len(self.index_row)
        self.index_k = torch.zeros(n_idx, num_slots, max(cfg.index_head_dim, 1), dtype=dtype, device=device)  # [Li, slots, Di]

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        item = torch.empty(0, dtype=dtype).element_size()
        return item * (cfg.num_layers * cfg.kv_entry_dim + len(cfg.indexer_layers) * cfg.index_head_dim)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor | None) -> None:
        self.kv[layer, slots] = kv.to(self.kv.dtype)
        if index_k is not None:
            self.index_k[self.index_row[layer], slots] = index_k.to(self.index_k.dtype)

    def read_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.kv[layer, slots]

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.index_k[self.index_row[layer], slots]
