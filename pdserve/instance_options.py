"""`InstanceOptions`: the flags `pdserve prefill` and `pdserve decode` share, declared once (the
field, its default, its help, its checks). `PrefillServerConfig` and `DecodeServerConfig` extend it
with their role's own options and override a field only where the role's default differs (the
ports). Torch-free, so the CLI builds its options without importing torch (pdserve/flags.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .choices import AttentionOps, Device, LinearOps, ModelDType, MoeOps, Switch, Transfer, check
from .flags import (
    ATTENTION_OPS_HELP,
    DEQUANTIZE_HELP,
    DEVICE_HELP,
    DTYPE_HELP,
    EXACT_DTYPE_HELP,
    GPU_IDS_HELP,
    INTERNAL_TOKEN_HELP,
    LINEAR_OPS_HELP,
    MODEL_HELP,
    MOE_EP_HELP,
    MOE_OPS_HELP,
    NODE_HELP,
    PREFIX_CACHE_HELP,
    SHUTDOWN_GRACE_HELP,
    option,
)
from .runtime.placement import check_device_fields, default_dtype

# --max-kv-tokens, one bound and one default for prefill, decode and `up` (per instance)
MIN_KV_TOKENS = 16
DEFAULT_MAX_KV_TOKENS = 65536  # on cpu; on cuda the decode sizes its pool by --gpu-memory-utilization


@dataclass(frozen=True)
class InstanceOptions(ABC):
    model: str = option(help=MODEL_HELP, cli_type=Optional[Path], cli_default=None)
    host: str = option("127.0.0.1", "Address the instance's HTTP API listens on.")
    port: int = option(8000, "Port of the instance's HTTP API.")
    dist_port: int = option(29500, "TCP port the ranks use to form their torch.distributed group.")
    dtype: str = option(  # "": float32 on cpu, bfloat16 on cuda (filled in by create)
        "", DTYPE_HELP, cli_type=Optional[ModelDType], cli_default=None
    )
    exact_dtype: bool = option(False, EXACT_DTYPE_HELP)
    device: str = option("cpu", DEVICE_HELP, choices=Device)
    gpu_ids: tuple[int, ...] = option((), GPU_IDS_HELP, cli_type=Optional[str], cli_default=None)
    attention_ops: str = option("auto", ATTENTION_OPS_HELP, choices=AttentionOps)
    linear_ops: str = option("auto", LINEAR_OPS_HELP, choices=LinearOps)
    moe_ops: str = option("auto", MOE_OPS_HELP, choices=MoeOps)
    moe_ep: bool = option(False, MOE_EP_HELP)
    dequantize: bool = option(False, DEQUANTIZE_HELP)
    threads_per_rank: int = option(
        1, "torch threads in each rank process (decode: also in the server's local prefill).", min=1
    )
    prefix_cache: str = option("on", PREFIX_CACHE_HELP, choices=Switch)
    transfer: str = option("tcp", choices=Transfer)
    max_queue: int = option(
        256,
        "Requests waiting (to be prefilled, or for KV pages) beyond this many are refused with 429 "
        "and Retry-After (bounded admission; the router then tries another instance).",
        min=1,
    )
    shutdown_grace_s: float = option(30.0, SHUTDOWN_GRACE_HELP, name="--shutdown-grace", min=0.0)
    # serving/auth.py; serve() requires one (the CLI adds --internal-token-file and the environment)
    internal_token: str | None = option(None, INTERNAL_TOKEN_HELP, cli_type=Optional[str], repr=False)
    # one instance over several hosts (runtime/node_group.py; the CLI fills these from the
    # LeaderWorkerSet environment when the flags are not given: runtime/nodes.py)
    nnodes: int = option(1, NODE_HELP["nnodes"], min=1, cli_type=Optional[int], cli_default=None)
    node_rank: int = option(0, NODE_HELP["node_rank"], min=0, cli_type=Optional[int], cli_default=None)
    dist_addr: str = option("", NODE_HELP["dist_addr"], cli_type=Optional[str], cli_default=None)
    node_timeout_s: float = option(10.0, NODE_HELP["node_timeout"], name="--node-timeout", min=0.5)
    gloo_ifname: str = option("", NODE_HELP["gloo_ifname"])
    nccl_ifname: str = option("", NODE_HELP["nccl_ifname"])
    nccl_ib_hca: str = option("", NODE_HELP["nccl_ib_hca"])

    @classmethod
    def create(cls, **given):
        """The config of these fields, with the defaults that follow from other fields filled in
        (`resolve`): the one way the CLI and `up` build one (a config is never changed once built)."""
        return cls(**cls.resolve(given))

    @classmethod
    def resolve(cls, given: dict) -> dict:
        """given, with the device named (its field default when missing) and dtype "" or missing:
        the device's default (float32 on cpu, bfloat16 on cuda)."""
        device = given.get("device", cls.__dataclass_fields__["device"].default)
        return {**given, "device": device, "dtype": given.get("dtype") or default_dtype(device)}

    @abstractmethod
    def world_size(self) -> int:
        """How many rank processes the instance runs (one GPU id each with --gpu-ids)."""

    def check_shared(self) -> None:
        """The shared fields' checks; fills dtype "" with the device's default. A role's
        `__post_init__` calls it after checking the fields `world_size` reads."""
        self.check_nodes()
        check_device_fields(self, self.world_size() // self.nnodes)  # --gpu-ids: one per rank of a node
        check(self.dtype, ModelDType, "--dtype")
        check(self.prefix_cache, Switch, "--prefix-cache")
        check(self.transfer, Transfer, "--transfer")
        if self.threads_per_rank < 1 or self.max_queue < 1:
            raise ValueError("--threads-per-rank and --max-queue must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}")

    def check_nodes(self) -> None:
        if self.nnodes < 1 or self.world_size() % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must divide the instance's {self.world_size()} ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}] (--nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.dist_addr:
            raise ValueError(
                "--nnodes > 1 needs --dist-addr HOST:PORT (node 0's address, the same on every node)"
            )
        if self.node_timeout_s < 0.5:
            raise ValueError(f"--node-timeout must be >= 0.5 s, got {self.node_timeout_s}")
        _, port = self.dist_endpoint()
        if self.port == port:
            raise ValueError("--port and --dist-port must differ")
        if self.nnodes > 1 and self.port == port + 1:
            raise ValueError(f"--port {self.port} is the node link's (the port after --dist-addr's)")

    def dist_endpoint(self) -> tuple[str, int]:
        """(host, port) of the ranks' rendezvous: --dist-addr, else 127.0.0.1 and --dist-port; a
        multi-node instance's control link listens on node 0 at the port after it."""
        from .runtime.nodes import parse_dist_addr

        return parse_dist_addr(self.dist_addr, self.dist_port)
