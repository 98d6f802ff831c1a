"""`PrefillWorkerConfig`: what every prefill rank is told at start, derived from the instance's
PrefillServerConfig in one place (`of_server`); tests and benches build it directly. The choices are
checked against the same sets (choices.py) as the server's flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..choices import CacheMode, Transfer, check
from ..transfer.frames import DEV_FRAME_KEY, cluster_frame_key


@dataclass(frozen=True)
class PrefillWorkerConfig:
    model_dir: str
    num_slots: int
    dtype: str = "float32"
    layout: str = "interleave"
    cache: str = "full"
    moe_tp: bool = False
    query_block: int = 256
    float32_islands: bool = True  # False: true float64 (see ModelConfig)
    transfer: str = "tcp"  # KV hand-off data path: "tcp" | "nixl"
    kv_residues: int = 0  # latent cache residue-major by this many residues (KVPool); 0: the CP size
    device: str = "cpu"  # "cuda": the GPU the launcher selected for this rank (runtime/device.py)
    attention_ops: str = "auto"  # engine/attn_ops.py
    linear_ops: str = "auto"  # engine/gemm_ops.py
    moe_ops: str = "auto"
    moe_ep: bool = False  # routed experts by id across the ranks (runtime/expert_parallel.py)
    keep_fp8: bool = False  # fp8 checkpoint weights stay fp8 (model/shard.py): cuda without --dequantize
    # data frames are signed with it (transfer/frames.py)
    frame_key: bytes = field(default=DEV_FRAME_KEY, repr=False)

    def __post_init__(self):
        check(self.transfer, Transfer, "--transfer")
        check(self.cache, CacheMode, "--cache")
        if self.kv_residues < 0:
            raise ValueError(f"kv_residues must be >= 0, got {self.kv_residues}")

    @classmethod
    def of_server(cls, cfg) -> "PrefillWorkerConfig":
        """Every rank's config, from the instance's PrefillServerConfig (the one place it is derived)."""
        return cls(
            cfg.model,
            cfg.num_slots,
            cfg.dtype,
            cfg.cp_layout,
            cfg.cache,
            cfg.moe_tp,
            transfer=cfg.transfer,
            kv_residues=cfg.kv_residues or cfg.cp_size,
            frame_key=cluster_frame_key(cfg.internal_token),
            device=cfg.device,
            attention_ops=cfg.attention_ops,
            linear_ops=cfg.linear_ops,
            moe_ops=cfg.moe_ops,
            moe_ep=cfg.moe_ep,
            keep_fp8=cfg.device == "cuda" and not cfg.dequantize,
            float32_islands=not cfg.exact_dtype,
        )
