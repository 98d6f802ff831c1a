"""`PrefillServerConfig`: a prefill instance's config and, field by field, its `pdserve prefill`
flags (pdserve/flags.py). Torch-free, so the CLI builds its options without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import CacheMode, Layout, Switch, check
from ..flags import option
from ..instance_options import DEFAULT_MAX_KV_TOKENS, MIN_KV_TOKENS, InstanceOptions
from .layouts import check_layout_allowed


@dataclass(frozen=True)
class PrefillServerConfig(InstanceOptions):
    port: int = option(8100, "Port of the instance's HTTP API.")
    cp_size: int = option(1, "Context-parallel ranks C_p: the prompt's tokens are split across them.", min=1)
    cp_layout: str = option("interleave", choices=Layout)
    cache: str = option("full", choices=CacheMode)
    chunk_size: int = option(
        4096,
        "Prompt tokens per prefill chunk; each chunk is split across the ranks, earlier chunks are read from the cache.",
        min=1,
    )
    moe_tp: bool = option(
        False,
        "Split MLP/MoE weights across the ranks (all-gather tokens, reduce-scatter outputs) instead of replicating them.",
    )
    max_kv_tokens: int = option(
        DEFAULT_MAX_KV_TOKENS,
        "KV cache capacity in tokens (per rank, every rank holds the same slots).",
        min=MIN_KV_TOKENS,
    )
    page_size: int = 16
    bootstrap_timeout_s: float = option(
        30.0,
        "Seconds a hand-off request waits for its decode instance's page reservation before it fails.",
        name="--bootstrap-timeout",
    )
    kv_residues: int = option(
        0,
        "Store each layer's latent cache residue-major by R residues (slot s at row (s % R) * ceil(slots / R) + s // R), so each rank of a decode instance with C_d = R finds its tokens in contiguous rows, which --transfer nixl WRITEs straight from the cache without packing. 0 (default): the CP size. Any value works with any decode instance; only the packing cost differs.",
        min=0,
    )

    handoff_stream: str = option(
        "on",
        "Stream each hand-off: every layer's KV rows leave for the decode instance as soon as the prefill stores them, so the transfer runs behind the compute instead of after it. off: the rows leave after the whole prompt is prefilled (for comparison).",
        choices=Switch,
    )

    def world_size(self) -> int:
        return self.cp_size

    def __post_init__(self):
        if self.cp_size < 1:
            raise ValueError(f"--cp-size must be >= 1, got {self.cp_size}")
        self.check_shared()
        if self.kv_residues < 0:
            raise ValueError(f"--kv-residues must be >= 0 (0: the CP size), got {self.kv_residues}")
        check(self.cache, CacheMode, "--cache")
        check(self.cp_layout, Layout, "--cp-layout")
        check(self.handoff_stream, Switch, "--handoff-stream")
        if self.chunk_size < 1 or self.max_kv_tokens < self.page_size:
            raise ValueError("--chunk-size must be >= 1 and --max-kv-tokens at least one page")
        if not 0 < self.bootstrap_timeout_s <= 86400:  # NaN and inf fail too
            raise ValueError(f"--bootstrap-timeout must be in (0, 86400] s, got {self.bootstrap_timeout_s}")

    @property
    def num_slots(self) -> int:
        """KV slots of every rank: --max-kv-tokens rounded up to whole pages."""
        return -(-self.max_kv_tokens // self.page_size) * self.page_size

    def validate_model(self) -> None:
        """Checks that need the checkpoint's config (a clear error before any rank starts)."""
        from ..model.config import ModelConfig

        mcfg = ModelConfig.from_pretrained(self.model)
        check_layout_allowed(mcfg.model_type, self.cp_layout)
        if self.moe_ep:
            mcfg.experts_per_rank(self.cp_size)
