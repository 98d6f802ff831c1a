"""`PrefillServerConfig`: a prefill instance's config and, field by field, its `pdserve prefill`
flags (pdserve/flags.py). Torch-free, so the CLI builds its options without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..choices import AttentionOps, CacheMode, Device, Layout, ModelDType, Switch, Transfer, check
from ..engine.placement import check_device_fields
from ..flags import (
    ATTENTION_OPS_HELP,
    DEVICE_HELP,
    DTYPE_HELP,
    EXACT_DTYPE_HELP,
    GPU_IDS_HELP,
    INTERNAL_TOKEN_HELP,
    MODEL_HELP,
    PREFIX_CACHE_HELP,
    SHUTDOWN_GRACE_HELP,
    option,
)
from .layouts import check_layout_allowed


@dataclass(frozen=True)
class PrefillServerConfig:
    model: str = option(help=MODEL_HELP, cli_type=Optional[Path], cli_default=None)
    cp_size: int = option(1, "Context-parallel ranks C_p: the prompt's tokens are split across them.", min=1)
    cp_layout: str = option(
        "interleave",
        "Token layout: interleave (token p on rank p % C_p; the only one for sparse-attention models), zigzag (2*C_p blocks, for dense models), contiguous (comparison only).",
        choices=Layout,
    )
    cache: str = option(
        "full",
        "full: every rank keeps every layer's cache; layer-split: each rank keeps a contiguous block of layers.",
        choices=CacheMode,
    )
    chunk_size: int = option(
        4096,
        "Prompt tokens per prefill chunk; each chunk is split across the ranks, earlier chunks are read from the cache.",
        min=1,
    )
    prefix_cache: str = option("on", PREFIX_CACHE_HELP, choices=Switch)
    moe_tp: bool = option(
        False,
        "Split MLP/MoE weights across the ranks (all-gather tokens, reduce-scatter outputs) instead of replicating them.",
    )
    host: str = option("127.0.0.1", "Address the HTTP control API listens on.")
    port: int = option(8100, "Port of the HTTP control API.")
    dist_port: int = option(29500, "TCP port the ranks use to form their torch.distributed group.")
    dtype: str = option(  # "": float32 on cpu, bfloat16 on cuda (filled in by __post_init__)
        "", DTYPE_HELP, cli_type=Optional[ModelDType], cli_default=None
    )
    exact_dtype: bool = option(False, EXACT_DTYPE_HELP)
    device: str = option("cpu", DEVICE_HELP, choices=Device)
    gpu_ids: tuple[int, ...] = option((), GPU_IDS_HELP, cli_type=Optional[str], cli_default=None)
    attention_ops: str = option("auto", ATTENTION_OPS_HELP, choices=AttentionOps)
    max_kv_tokens: int = option(
        65536, "KV cache capacity in tokens (per rank, every rank holds the same slots).", min=16
    )
    page_size: int = 16
    threads_per_rank: int = option(1, "torch threads in each rank process.", min=1)
    bootstrap_timeout_s: float = option(
        30.0,
        "Seconds a hand-off request waits for its decode instance's page reservation before it fails.",
        name="--bootstrap-timeout",
    )
    transfer: str = option(
        "tcp",
        "KV hand-off data path to decode instances: tcp (ZMQ over TCP) or nixl (NIXL/UCX one-sided WRITEs; RDMA or NVLink where present). Both sides must use the same.",
        choices=Transfer,
    )
    max_queue: int = option(
        256,
        "Requests waiting to be prefilled beyond this many are refused with 429 and Retry-After (bounded admission; the router then tries another instance).",
        min=1,
    )
    kv_residues: int = option(
        0,
        "Store each layer's latent cache residue-major by R residues (slot s at row (s % R) * ceil(slots / R) + s // R), so each rank of a decode instance with C_d = R finds its tokens in contiguous rows, which --transfer nixl WRITEs straight from the cache without packing. 0 (default): the CP size. Any value works with any decode instance; only the packing cost differs.",
        min=0,
    )
    shutdown_grace_s: float = option(30.0, SHUTDOWN_GRACE_HELP, name="--shutdown-grace", min=0.0)
    # engine/auth.py; serve() requires one (the CLI adds --internal-token-file and the environment)
    internal_token: str | None = option(None, INTERNAL_TOKEN_HELP, cli_type=Optional[str], repr=False)

    def __post_init__(self):
        if self.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.kv_residues < 0:
            raise ValueError(f"--kv-residues must be >= 0 (0: the CP size), got {self.kv_residues}")
        if self.cp_size < 1:
            raise ValueError(f"--cp-size must be >= 1, got {self.cp_size}")
        check(self.cache, CacheMode, "--cache")
        check(self.cp_layout, Layout, "--cp-layout")
        check(self.prefix_cache, Switch, "--prefix-cache")
        check(self.transfer, Transfer, "--transfer")
        check_device_fields(self, self.cp_size)  # fills dtype "" with the device's default
        check(self.dtype, ModelDType, "--dtype")
        if self.chunk_size < 1 or self.max_kv_tokens < self.page_size:
            raise ValueError("--chunk-size must be >= 1 and --max-kv-tokens at least one page")
        if self.port == self.dist_port:
            raise ValueError("--port and --dist-port must differ")
        if self.bootstrap_timeout_s <= 0:
            raise ValueError("--bootstrap-timeout must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}")

    @property
    def num_slots(self) -> int:
        """KV slots of every rank: --max-kv-tokens rounded up to whole pages."""
        return -(-self.max_kv_tokens // self.page_size) * self.page_size

    def validate_model(self) -> None:
        """Checks that need the checkpoint's config (a clear error before any rank starts)."""
        from ..model.config import ModelConfig

        check_layout_allowed(ModelConfig.from_pretrained(self.model).model_type, self.cp_layout)
