"""Helpers that read the single-rank engine's results, for the parallel-equality tests."""

from __future__ import annotations

import socket

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request, SamplingParams
from pdserve.engine.scheduler import Chunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_prefill(engine: LLMEngine, ids: list[int]):
    """Single-rank prefill of ids: (last-position logits [V], {layer: (latent [n, D], index keys [n, Di] or None)})."""
    req = Request(list(ids), SamplingParams(max_tokens=1))
    req.pages = engine.allocator.allocate(len(ids))
    try:
        logits = engine.runner.run([Chunk(req, 0, len(ids))])[0]
        slots = torch.tensor(engine.allocator.slots(req.pages, 0, len(ids)))
        cfg = engine.config
        entries = {
            layer: (engine.pool.read_kv(layer, slots).clone(),
                    engine.pool.read_index(layer, slots).clone() if cfg.has_indexer(layer) else None)
            for layer in range(cfg.num_layers)
        }
        return logits, entries
    finally:
        engine.allocator.free(req.pages)


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-8) -> None:
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and err <= tol, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}, max abs {err}"
