"""Architecture/size presets for the random checkpoints written by ``pdserve make-model``.

Each preset is the exact Hugging Face ``config.json`` dict that transformers 5.23 accepts for
``GlmMoeDsaForCausalLM``, ``DeepseekV32ForCausalLM`` or ``DeepseekV3ForCausalLM``.  The tiny
presets exist for tests (a forward pass in milliseconds); the small ones for benchmarks; the medium
ones for the decode roofline, where a step's bytes, not its calls, set its time; the mla
ones have the released MLA and indexer dims (kv_lora_rank 512, rope 64, index heads of 128, top-k
2048) in two layers: what flashinfer's MLA kernels are built for (tests/gpu, bench/gpu.py).

The presets deliberately differ in a few places so that every code path is exercised:
glm_moe_dsa uses the default rope and alternates full/shared indexer layers, deepseek_v32
uses yarn and runs the indexer on every layer, deepseek_v3 uses yarn without an indexer and
(tiny only) has no q LoRA, so the plain ``q_proj`` path is covered.
"""

from __future__ import annotations

import copy
from typing import Any

from pdserve.checkpoints.bpe_builder import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

ARCHS = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
SIZES = ("tiny", "small", "mla", "medium")

_ARCHITECTURES = {
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

# Fields shared by every arch, per size.
_BASE: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "max_position_embeddings": 8192,
    },
    "small": {
        "vocab_size": 4096,
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 256,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "intermediate_size": 1408,
        "moe_intermediate_size": 256,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "max_position_embeddings": 65536,
    },
    "mla": {
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "max_position_embeddings": 65536,
    },
}

# weight-bound: the small preset's routing, ~1.7 GB of float32 weights, ~0.7 GB read per decode step
# at batch 1 (4 of 16 experts), so a step's bytes outweigh its per-call costs (bench/engine.py)
_BASE["medium"] = {
    **_BASE["small"],
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 4096,
    "moe_intermediate_size": 1024,
}

# DSA indexer fields, per size (only for the sparse archs).
_INDEXER: dict[str, dict[str, Any]] = {
    "tiny": {"index_topk": 8, "index_n_heads": 8, "index_head_dim": 16},
    "small": {"index_topk": 256, "index_n_heads": 8, "index_head_dim": 64},
    "mla": {"index_topk": 2048, "index_n_heads": 8, "index_head_dim": 128},
    "medium": {"index_topk": 512, "index_n_heads": 16, "index_head_dim": 128},
}

# yarn's original context, per size: a quarter of max_position_embeddings (factor 4).
_YARN_ORIGINAL_MAX = {"tiny": 2048, "small": 16384, "mla": 16384, "medium": 16384}

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "output_router_logits": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "dtype": "float32",
}


def _check(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


def _rope(arch: str, size: str) -> dict[str, Any]:
    if arch == "glm_moe_dsa":
        return {"rope_type": "default", "rope_theta": 10000.0}
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": _YARN_ORIGINAL_MAX[size],
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def _sparse_fields(size: str, num_layers: int) -> dict[str, Any]:
    # The per-layer lists are derived by transformers when absent; writing them out makes
    # config.json identical to what save_pretrained writes and explicit for our loader.
    dense = _COMMON["first_k_dense_replace"]
    return {
        **_INDEXER[size],
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (num_layers - dense),
        "layer_types": ["indexed_attention"] * num_layers,
        "mlp_bias": False,
    }


def _arch_fields(arch: str, size: str, num_layers: int) -> dict[str, Any]:
    if arch == "glm_moe_dsa":
        # Alternate full/shared starting with full: a "shared" layer reuses the previous
        # full layer's top-k (and has no indexer weights), so layer 0 must be full.
        kinds = ["full" if i % 2 == 0 else "shared" for i in range(num_layers)]
        return {**_sparse_fields(size, num_layers), "indexer_types": kinds}
    if arch == "deepseek_v32":
        return _sparse_fields(size, num_layers)
    # deepseek_v3: no MTP layers (we never write them), interleaved rope as the real model.
    fields: dict[str, Any] = {"rope_interleave": True, "num_nextn_predict_layers": 0, "pretraining_tp": 1}
    if size == "tiny":
        fields["q_lora_rank"] = None  # exercise the plain q_proj path
    return fields


def hf_config(arch: str, size: str) -> dict[str, Any]:
    """Return the Hugging Face ``config.json`` dict for ``arch`` at ``size``."""
    _check(arch, ARCHS, "arch")
    _check(size, SIZES, "size")
    base = copy.deepcopy(_BASE[size])
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        **base,
        **copy.deepcopy(_COMMON),
        "rope_parameters": _rope(arch, size),
    }
    cfg.update(_arch_fields(arch, size, base["num_hidden_layers"]))
    # Derived fields transformers computes (and saves): rope applies to the rope slice only.
    cfg["head_dim"] = cfg["qk_rope_head_dim"]
    cfg["qk_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return cfg


def glm53_like_config() -> dict[str, Any]:
    """GLM-5.3's cache shapes (78 layers, 512 + 64 latent dims, 21 indexer layers of 128, the first
    at layer 0), the rest plausible: for capacity accounting (the article's numbers), not make-model."""
    full_layers = {k * 78 // 21 for k in range(21)}
    return {
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880,
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 3,
        "max_position_embeddings": 202752,
        "rope_theta": 1e6,
        "index_topk": 2048,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "indexer_types": ["full" if i in full_layers else "shared" for i in range(78)],
    }
