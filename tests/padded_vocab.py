"""A tiny checkpoint whose LM head is padded past its tokenizer, as released checkpoints often are
(rows added to round the vocabulary up): config.json's vocab_size is twice the tokenizer's, and the
padded rows are 100 x the real ones, so that at every step the padded copy of the best real token has
the largest logit: a sampler that could emit a padded id would (tests/engine/test_decodable_vocab.py
checks that it does when nothing masks them)."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.checkpoints.bpe_builder import write_tokenizer_files
from pdserve.checkpoints.presets import hf_config
from pdserve.checkpoints.random_checkpoint import make_model

SCALE = 100.0


def make_padded_checkpoint(out_dir: str | Path, arch: str = "glm_moe_dsa", seed: int = 0) -> tuple[Path, int]:
    """(the checkpoint's path, its tokenizer's size); config vocab_size is twice that."""
    cfg = hf_config(arch, "tiny")
    real = cfg["vocab_size"]
    path = make_model(out_dir, arch, "tiny", seed=seed, config_overrides={"vocab_size": 2 * real})
    write_tokenizer_files(path, real, cfg["max_position_embeddings"])  # the tokenizer stays unpadded
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    weights = load_file(str(file))
    head = weights["lm_head.weight"]  # [2 x real, hidden]
    head[real:] = SCALE * head[:real]
    save_file(weights, str(file), metadata=metadata)
    return path, real
