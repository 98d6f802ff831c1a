"""``pdserve make-model``: write a deterministic random Hugging Face checkpoint.

The tensor names and shapes are those transformers 5.23's ``save_pretrained`` writes for
``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` / ``DeepseekV3ForCausalLM`` (per-expert
``mlp.experts.E.*`` tensors, not the fused in-memory layout).  Values are a pure function of
(seed, tensor name), so the same seed always gives byte-identical files, however the
tensors are sharded.

``quantize="fp8"`` writes the layout of the released FP8 checkpoints (quant.py): every 2-D
projection weight as float8_e4m3fn plus a float32 ``weight_scale_inv`` per 128 x 128 block (partial
blocks at the edges), norms / embeddings / LM head / router / indexer weights_proj unquantized, and
``quantization_config`` in config.json.
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

from pdserve.checkpoints import bpe_builder
from pdserve.checkpoints.presets import hf_config
from pdserve.model.quant import FP8_BLOCK, SCALE_SUFFIX, QuantConfig, quantizable, quantize_fp8

QUANTIZE_METHODS = ("fp8",)

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


def _stored_bytes(name: str, spec: TensorSpec, quant: QuantConfig | None) -> int:
    """Bytes `name` takes in the files: float32, or fp8 plus its float32 block scales."""
    if quant is None or not quantizable(name, spec.shape):
        return spec.nbytes
    rows, cols = quant.scale_shape(spec.shape)
    return spec.nbytes // _BYTES_PER_ELEMENT + rows * cols * 4


def _plan_shards(
    specs: dict[str, TensorSpec], max_shard_bytes: int | None, quant: QuantConfig | None = None
) -> list[list[str]]:
    """Greedy packing in name order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [list(specs)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        nbytes = _stored_bytes(name, spec, quant)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _stored_tensors(
    seed: int, name: str, spec: TensorSpec, quant: QuantConfig | None
) -> dict[str, torch.Tensor]:
    w = _init_tensor(seed, name, spec)
    if quant is None or not quantizable(name, spec.shape):
        return {name: w}
    q, scale = quantize_fp8(w, quant.block)
    return {name: q, name + SCALE_SUFFIX: scale}


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(
    tmp: Path,
    specs: dict[str, TensorSpec],
    seed: int,
    max_shard_bytes: int | None,
    quant: QuantConfig | None = None,
) -> None:
    shards = _plan_shards(specs, max_shard_bytes, quant)
    if max_shard_bytes is None:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, names in zip(files, shards):
        # One shard in memory at a time keeps `small` (~200 MB) cheap when sharded.
        tensors = {k: t for n in names for k, t in _stored_tensors(seed, n, specs[n], quant).items()}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if max_shard_bytes is not None:
        total = sum(_stored_bytes(n, spec, quant) for n, spec in specs.items())
        _dump_json(
            tmp / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )


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


def make_model(
    out_dir: str | Path,
    arch: str,
    size: str,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    quantize: str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a complete random HF checkpoint for ``arch``/``size`` to ``out_dir``; return its path.

    quantize: None (float32 weights) or "fp8" (the released block-quantized layout).
    config_overrides: config.json fields to change (tests use it for dimensions past one 128 block)."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if quantize is not None and quantize not in QUANTIZE_METHODS:
        raise ValueError(
            f"unknown quantize method {quantize!r}; expected one of {', '.join(QUANTIZE_METHODS)}"
        )
    cfg = {**hf_config(arch, size), **(config_overrides or {})}
    quant = QuantConfig("fp8", FP8_BLOCK) if quantize else None
    if quant is not None:
        cfg["quantization_config"] = quant.to_config_dict()
    out = Path(out_dir).absolute()
    _prepare_destination(out, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_weights(tmp, tensor_specs(cfg), seed, max_shard_bytes, quant)
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
