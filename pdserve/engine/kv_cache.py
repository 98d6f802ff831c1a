"""KV storage: the tensors that hold latent cache entries and index keys, addressed by slot.

Bookkeeping (which request owns which slots) lives in PageAllocator; this class only stores.
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig


class KVPool:
    """Holds the entries of `layers` (default: every layer); a layer-split prefill rank holds a few."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 layers: list[int] | None = None):
        self.num_slots = num_slots
        self.layers = list(range(cfg.num_layers)) if layers is None else list(layers)
        self.kv_row = {layer: i for i, layer in enumerate(self.layers)}
        self.kv = torch.zeros(len(self.layers), num_slots, cfg.kv_entry_dim, dtype=dtype, device=device)  # [L, slots, c+rope]
        indexed = [layer for layer in self.layers if cfg.has_indexer(layer)]
        self.index_row = {layer: i for i, layer in enumerate(indexed)}
        self.index_k = torch.zeros(len(indexed), num_slots, max(cfg.index_head_dim, 1), dtype=dtype, device=device)  # [Li, slots, Di]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.index_k.numel() * self.index_k.element_size()

    def holds(self, layer: int) -> bool:
        return layer in self.kv_row

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        item = torch.empty(0, dtype=dtype).element_size()
        return item * (cfg.num_layers * cfg.kv_entry_dim + len(cfg.indexer_layers) * cfg.index_head_dim)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor | None) -> None:
        self.kv[self.kv_row[layer], slots] = kv.to(self.kv.dtype)
        if index_k is not None:
            self.index_k[self.index_row[layer], slots] = index_k.to(self.index_k.dtype)

    def read_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.kv[self.kv_row[layer], slots]

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.index_k[self.index_row[layer], slots]
