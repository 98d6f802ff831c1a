"""Model configuration read from a Hugging Face checkpoint's config.json.

One frozen dataclass covers the three supported architectures:
  glm_moe_dsa   GLM-5 style MLA + DeepSeek Sparse Attention; the indexer uses interleaved rope and
                layers may be `shared` (reuse the previous full layer's top-k selection).
  deepseek_v32  DeepSeek-V3.2: MLA + DSA in every layer; the indexer uses half-split rope.
  deepseek_v3   plain MLA (dense attention); optional q_lora_rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .quant import QuantConfig

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
SPARSE_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be served; the message names the field."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" | "yarn"
    theta: float
    dim: int  # rotary dims per head (qk_rope_head_dim)
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(f"unsupported rope_type {self.rope_type!r} (supported: default, yarn)")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: tuple[str, ...]  # per layer: "dense" | "sparse" (MoE)
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool  # main MLA rope layout
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    # DeepSeek Sparse Attention (None/empty for deepseek_v3)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()  # per layer: "full" runs the indexer, "shared" reuses
    indexer_rope_interleave: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Multi-token-prediction layers shipped after the last decoder layer (model.layers.{L}...); not served.
    num_nextn_predict_layers: int = 0
    quantization: QuantConfig | None = None  # the checkpoint's weight format (None: plain floats)
    # Run-time numerics, not from config.json. The reference computes norms, the router and the
    # indexer in float32 even in a float64 model ("float32 islands"); we do the same by default so
    # float64 runs match it. False computes them in the model dtype: true float64, which parallel
    # equality checks need, since float32 rounding turns 1e-16 reorderings into 1e-7 differences.
    float32_islands: bool = True

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {self.model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if len(self.mlp_layer_types) != self.num_layers:
            raise ConfigError(
                f"mlp_layer_types has {len(self.mlp_layer_types)} entries, expected {self.num_layers}"
            )
        if self.is_sparse:
            if len(self.indexer_types) != self.num_layers:
                raise ConfigError(
                    f"indexer_types has {len(self.indexer_types)} entries, expected {self.num_layers}"
                )
            if self.indexer_types[0] != "full":
                raise ConfigError(
                    "indexer_types[0] must be 'full': a shared layer reuses an earlier selection"
                )
            if self.index_head_dim <= self.qk_rope_head_dim:
                raise ConfigError("index_head_dim must exceed qk_rope_head_dim")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ConfigError(
                f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}"
            )

    # ---- derived quantities -------------------------------------------------------------
    @property
    def is_sparse(self) -> bool:
        return self.model_type in SPARSE_MODEL_TYPES

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_entry_dim(self) -> int:
        """Values per token and layer in the latent cache: normed c_kv then roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def experts_per_rank(self, world: int) -> int:
        """Expert parallelism (--moe-ep) over `world` ranks: each rank's whole routed experts."""
        return experts_per_rank(self.n_routed_experts, world)

    def has_indexer(self, layer: int) -> bool:
        return self.is_sparse and self.indexer_types[layer] == "full"

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.has_indexer(i))

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale with yarn's mscale_all_dim correction (as the reference applies it)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        n_layers = _req(d, "num_hidden_layers")
        first_dense = d.get("first_k_dense_replace", 0)
        mlp_types = d.get("mlp_layer_types") or (
            ["dense"] * min(first_dense, n_layers) + ["sparse"] * max(n_layers - first_dense, 0)
        )
        if d.get("n_routed_experts") in (None, 0):
            mlp_types = ["dense"] * n_layers
        sparse = model_type in SPARSE_MODEL_TYPES
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=_req(d, "vocab_size"),
            hidden_size=_req(d, "hidden_size"),
            num_layers=n_layers,
            num_heads=_req(d, "num_attention_heads"),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=_req(d, "kv_lora_rank"),
            qk_nope_head_dim=_req(d, "qk_nope_head_dim"),
            qk_rope_head_dim=_req(d, "qk_rope_head_dim"),
            v_head_dim=_req(d, "v_head_dim"),
            intermediate_size=_req(d, "intermediate_size"),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            n_routed_experts=d.get("n_routed_experts") or 0,
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            mlp_layer_types=tuple(mlp_types),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_dict(d),
            rope_interleave=bool(d.get("rope_interleave", True)) if model_type == "deepseek_v3" else True,
            max_position_embeddings=_req(d, "max_position_embeddings"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            index_topk=d.get("index_topk", 0) if sparse else 0,
            index_n_heads=d.get("index_n_heads", 0) if sparse else 0,
            index_head_dim=d.get("index_head_dim", 0) if sparse else 0,
            indexer_types=_indexer_types(d, n_layers) if sparse else (),
            indexer_rope_interleave=model_type == "glm_moe_dsa",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            quantization=QuantConfig.from_config_dict(d),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))


def experts_per_rank(n_experts: int, world: int) -> int:
    """E / world routed experts per rank; a model without them, or an uneven split, is refused."""
    if not n_experts:
        raise ValueError("--moe-ep: the model has no routed experts")
    if n_experts % world:
        raise ValueError(
            f"--moe-ep: the model's {n_experts} routed experts cannot be split evenly over {world} ranks"
        )
    return n_experts // world


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _req(d: dict, key: str):
    if d.get(key) is None:
        raise ConfigError(f"config.json is missing required field {key!r}")
    return d[key]


def _rope_from_dict(d: dict) -> RopeConfig:
    # transformers v5 writes `rope_parameters`; older checkpoints use `rope_theta` + `rope_scaling`.
    p = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = p.get("rope_type", p.get("type", "default"))
    theta = p.get("rope_theta", d.get("rope_theta", 10000.0))
    dim = _req(d, "qk_rope_head_dim")
    if rope_type == "default":
        return RopeConfig("default", float(theta), dim)
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    if orig is None:
        orig = d["max_position_embeddings"]
    if factor is None:
        factor = d["max_position_embeddings"] / orig
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        dim=dim,
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(p.get("beta_fast") or 32),
        beta_slow=float(p.get("beta_slow") or 1),
        mscale=p.get("mscale"),
        mscale_all_dim=p.get("mscale_all_dim"),
        attention_factor=p.get("attention_factor"),
        truncate=bool(p.get("truncate", True)),
    )


def _indexer_types(d: dict, n_layers: int) -> tuple[str, ...]:
    # Same precedence as the reference: explicit list, then a F/S pattern, then freq/offset.
    if d.get("indexer_types"):
        return tuple(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return (
            tuple({"F": "full", "S": "shared"}[c] for c in pattern)
            if isinstance(pattern, str)
            else tuple(pattern)
        )
    if d.get("model_type") != "glm_moe_dsa":
        return ("full",) * n_layers
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return tuple("full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers))
