"""Helpers that read the single-rank engine's results, for the parallel-equality tests."""

from __future__ import annotations

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.serving.ports import free_port  # noqa: F401 (the tests import it from here)


def reference_prefill(engine: LLMEngine, ids: list[int]):
    """Single-rank prefill of ids: (last-position logits [V], {layer: (latent [n, D], index keys [n, Di] or None)})."""
    logits, kv, index = engine.prefill_with_cache(ids)
    return logits, {layer: (kv[layer], index.get(layer)) for layer in range(engine.config.num_layers)}


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = 1e-8) -> None:
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert a.shape == b.shape and err <= tol, (
        f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}, max abs {err}"
    )


def assert_prefill_cache(inst, slots: list[int], want_entries: dict, tag: str) -> set[int]:
    """Every prefill rank's cache entries at `slots` equal the reference's (reference_prefill);
    returns the layers the ranks hold between them."""
    held = set()
    for rank, dump in enumerate(inst.dump_cache(slots)):
        for layer, (kv, idx) in dump.items():
            held.add(layer)
            assert_close(kv, want_entries[layer][0], f"{tag} rank {rank} layer {layer} latent")
            if want_entries[layer][1] is not None:
                assert_close(idx, want_entries[layer][1], f"{tag} rank {rank} layer {layer} index keys")
    return held
