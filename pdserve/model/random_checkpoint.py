"""``pdserve make-model``: write a deterministic random Hugging Face checkpoint.

The tensor names and shapes are those transformers 5.23's ``save_pretrained`` writes for
``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` / ``DeepseekV3ForCausalLM`` (per-expert
``mlp.experts.E.*`` tensors, not the fused in-memory layout).  Values are a pure function of
(seed, tensor name), so the same seed always gives byte-identical files, however the
tensors are sharded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.model import bpe_builder
from pdserve.model.presets import hf_config

# How each tensor is initialised; see _init_tensor.
LINEAR, EMBEDDING, NORM, BIAS = "linear", "embedding", "norm", "bias"
_BYTES_PER_ELEMENT = 4  # float32


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str

    @property
    def nbytes(self) -> int:
        n = _BYTES_PER_ELEMENT
        for d in self.shape:
            n *= d
        return n


def _attention_specs(cfg: dict[str, Any], p: str, has_indexer: bool) -> dict[str, TensorSpec]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_rank, q_rank = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    s = {
        f"{p}.kv_a_proj_with_mqa.weight": TensorSpec((kv_rank + rope, h), LINEAR),
        f"{p}.kv_a_layernorm.weight": TensorSpec((kv_rank,), NORM),
        f"{p}.kv_b_proj.weight": TensorSpec((heads * (nope + v), kv_rank), LINEAR),
        f"{p}.o_proj.weight": TensorSpec((h, heads * v), LINEAR),
    }
    if q_rank is None:
        s[f"{p}.q_proj.weight"] = TensorSpec((heads * (nope + rope), h), LINEAR)
    else:
        s[f"{p}.q_a_proj.weight"] = TensorSpec((q_rank, h), LINEAR)
        s[f"{p}.q_a_layernorm.weight"] = TensorSpec((q_rank,), NORM)
        s[f"{p}.q_b_proj.weight"] = TensorSpec((heads * (nope + rope), q_rank), LINEAR)
    if has_indexer:
        ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
        s[f"{p}.indexer.wq_b.weight"] = TensorSpec((ih * idim, q_rank), LINEAR)
        s[f"{p}.indexer.wk.weight"] = TensorSpec((idim, h), LINEAR)
        s[f"{p}.indexer.k_norm.weight"] = TensorSpec((idim,), NORM)
        s[f"{p}.indexer.k_norm.bias"] = TensorSpec((idim,), BIAS)
        s[f"{p}.indexer.weights_proj.weight"] = TensorSpec((ih, h), LINEAR)
    return s


def _mlp_specs(p: str, hidden: int, inter: int) -> dict[str, TensorSpec]:
    return {
        f"{p}.gate_proj.weight": TensorSpec((inter, hidden), LINEAR),
        f"{p}.up_proj.weight": TensorSpec((inter, hidden), LINEAR),
        f"{p}.down_proj.weight": TensorSpec((hidden, inter), LINEAR),
    }


def _moe_specs(cfg: dict[str, Any], p: str) -> dict[str, TensorSpec]:
    h, inter, n = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    s = {
        f"{p}.gate.weight": TensorSpec((n, h), LINEAR),
        f"{p}.gate.e_score_correction_bias": TensorSpec((n,), BIAS),
    }
    for e in range(n):
        s.update(_mlp_specs(f"{p}.experts.{e}", h, inter))
    s.update(_mlp_specs(f"{p}.shared_experts", h, inter * cfg["n_shared_experts"]))
    return s


def _has_indexer(cfg: dict[str, Any], layer: int) -> bool:
    if "index_topk" not in cfg:
        return False
    # glm_moe_dsa's "shared" layers reuse the previous full layer's top-k and own no indexer.
    kinds = cfg.get("indexer_types")
    return kinds is None or kinds[layer] == "full"


def tensor_specs(cfg: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint for ``cfg`` (a preset dict), keyed by name, sorted."""
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    s = {
        "model.embed_tokens.weight": TensorSpec((vocab, h), EMBEDDING),
        "model.norm.weight": TensorSpec((h,), NORM),
    }
    if not cfg.get("tie_word_embeddings", False):
        s["lm_head.weight"] = TensorSpec((vocab, h), LINEAR)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = TensorSpec((h,), NORM)
        s[f"{p}.post_attention_layernorm.weight"] = TensorSpec((h,), NORM)
        s.update(_attention_specs(cfg, f"{p}.self_attn", _has_indexer(cfg, i)))
        if i < cfg["first_k_dense_replace"]:
            s.update(_mlp_specs(f"{p}.mlp", h, cfg["intermediate_size"]))
        else:
            s.update(_moe_specs(cfg, f"{p}.mlp"))
    return dict(sorted(s.items()))


def num_parameters(cfg: dict[str, Any]) -> int:
    return sum(spec.nbytes for spec in tensor_specs(cfg).values()) // _BYTES_PER_ELEMENT


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_tensor(seed: int, name: str, spec: TensorSpec) -> torch.Tensor:
    """Random values that keep activations O(1) and leave no weight at its default."""
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    x = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.kind == LINEAR:
        return x * spec.shape[1] ** -0.5  # N(0, 1/fan_in)
    if spec.kind == NORM:
        return 1.0 + 0.1 * x
    if spec.kind == BIAS:
        return 0.1 * x
    return x  # embeddings: N(0, 1)


def _plan_shards(specs: dict[str, TensorSpec], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy packing in name order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [list(specs)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += spec.nbytes
    return shards


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(tmp: Path, specs: dict[str, TensorSpec], seed: int, max_shard_bytes: int | None) -> None:
    shards = _plan_shards(specs, max_shard_bytes)
    if max_shard_bytes is None:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, names in zip(files, shards):
        # One shard in memory at a time keeps `small` (~200 MB) cheap when sharded.
        tensors = {n: _init_tensor(seed, n, specs[n]) for n in names}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
    if max_shard_bytes is not None:
        weight_map = {n: f for f, names in zip(files, shards) for n in names}
        total = sum(spec.nbytes for spec in specs.values())
        _dump_json(tmp / "model.safetensors.index.json",
                   {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": False,
    }


def _prepare_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)


def _move_into_place(tmp: Path, out: Path) -> None:
    """Swap the finished temp dir in, so `out` is never a half-written checkpoint."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rmdir(old)
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def make_model(out_dir: str | Path, arch: str, size: str, seed: int = 0,
               max_shard_bytes: int | None = None, overwrite: bool = False,
               overrides: dict[str, Any] | None = None) -> Path:
    """Write a complete random HF checkpoint for ``arch``/``size`` to ``out_dir``; return its path.
    ``overrides`` replaces preset config fields (e.g. more attention heads, for TP over 3 ranks)."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    cfg = {**hf_config(arch, size), **(overrides or {})}
    out = Path(out_dir).absolute()
    _prepare_destination(out, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_weights(tmp, tensor_specs(cfg), seed, max_shard_bytes)
        bpe_builder.write_tokenizer_files(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
        _dump_json(tmp / "generation_config.json", _generation_config(cfg))
        # config.json last: its presence is what marks a directory as a checkpoint.
        _dump_json(tmp / "config.json", cfg)
        # mkdtemp makes the dir 0700 and safetensors writes 0600; a checkpoint is meant to be shared.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
