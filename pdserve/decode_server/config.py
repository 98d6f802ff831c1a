"""`DecodeServerConfig`: a decode instance's config and, field by field, its `pdserve decode`
flags (pdserve/flags.py). Torch-free, so the CLI builds its options without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..choices import CpuComm, DcpComm, DcpIndex, KVCacheDType, Switch, check, values
from ..flags import option
from ..instance_options import DEFAULT_MAX_KV_TOKENS, MIN_KV_TOKENS, InstanceOptions
from ..kvcache import capacity
from ..model.config import ModelConfig
from ..runtime.memory_check import DEFAULT_GPU_MEMORY_UTILIZATION, check_gpu_memory_utilization

_WILDCARDS = ("0.0.0.0", "::", "*", "")


@dataclass(frozen=True)
class DecodeServerConfig(InstanceOptions):
    port: int = option(8200, "Port of the instance's HTTP API.")
    dist_port: int = option(29600, "TCP port the ranks use to form their torch.distributed group.")
    tp_size: int = option(
        1, "Decode ranks W: attention heads are split across them (tensor parallel).", min=1
    )
    dcp_size: int = option(
        1,
        "Decode context-parallel size C_d (must divide --tp-size): each group of C_d ranks splits the KV cache by token.",
        min=1,
    )
    dcp_index: str = option("copy", choices=DcpIndex)
    dcp_comm: str = option("a2a", choices=DcpComm)
    replicate_q_proj: bool = option(
        False,
        "Each rank keeps the query projection for every head slice of its DCP group, so queries need no all-gather (more weight memory).",
    )
    kv_cache_dtype: str = option("auto", choices=KVCacheDType)
    # KV budget in bytes per rank (the CLI takes text such as 80GiB); at most one of this and max_kv_tokens
    kv_memory: int | None = option(
        None,
        "KV cache budget per rank, e.g. 80GiB, 512MiB or plain bytes; sets the token capacity (instead of --max-kv-tokens).",
        cli_type=Optional[str],
    )
    max_kv_tokens: int | None = (
        option(  # neither given: --gpu-memory-utilization (cuda), DEFAULT_MAX_KV_TOKENS (cpu)
            None,
            "KV cache capacity in tokens of the whole instance, rounded up to whole pages (default: on cuda "
            f"what --gpu-memory-utilization leaves, on cpu {DEFAULT_MAX_KV_TOKENS}; unless --kv-memory is given).",
            min=MIN_KV_TOKENS,
            cli_type=Optional[int],
        )
    )
    gpu_memory_utilization: float = option(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        "--device cuda without --kv-memory or --max-kv-tokens: the share of each GPU's memory a rank may "
        "use; the KV pool takes what the weights, the workspace and what is already in use leave of it "
        "(whole pages, the same on every rank; printed at startup, total_tokens in GET /info). An "
        f"explicit pool size is still checked against free memory. Accepted and ignored on cpu ({DEFAULT_MAX_KV_TOKENS} tokens).",
    )
    page_size: int = option(
        64, "KV slots per page; must be a multiple of --dcp-size (pages are C_d-wide).", min=1
    )
    max_batch: int = option(64, "Most requests decoded together in one step (continuous batching).", min=1)
    cuda_graphs: str = option(  # "": the default, filled in: auto on cuda (on where it can run), else off
        "",
        "Replay each decode step from a CUDA graph, one per batch bucket (1, 2, 4, ... up to "
        "--max-batch) and page-table width, captured on first use. Default: on with --device cuda "
        "where the step can be captured (not with the flashinfer attention ops, nor with ranks "
        "sharing a GPU: each rank prints why), off on cpu. on where it cannot run is an error.",
        cli_type=Optional[Switch],
        cli_default=None,
    )
    cpu_comm: str = option("auto", choices=CpuComm)
    transfer_timeout_s: float = option(
        30.0,
        "Seconds a hand-off request waits for the prefill's rows after its pages were reserved before it fails.",
        name="--transfer-timeout",
    )
    heartbeat_timeout_s: float = option(
        5.0,
        "Seconds of silence (no heartbeat) from a prefill instance after which its hand-offs in flight fail (it died).",
        name="--heartbeat-timeout",
    )
    data_host: str = option(
        "127.0.0.1",
        "Address the ranks' TCP receivers (--transfer tcp) listen on and advertise to prefill ranks; on a cluster, this host's address that prefill hosts can reach (e.g. the pod IP).",
    )
    transfer_quarantine_s: float = option(
        60.0,
        "--transfer nixl: seconds the pages of a hand-off that failed while its prefill may still be sending stay out of use (NIXL WRITEs land in the cache itself; a late one must not reach another request).",
        name="--transfer-quarantine",
    )

    def world_size(self) -> int:
        return self.tp_size

    @classmethod
    def resolve(cls, given: dict) -> dict:
        """InstanceOptions.resolve, and --cuda-graphs (auto on cuda, off on cpu) and on cpu without
        --kv-memory --max-kv-tokens (DEFAULT_MAX_KV_TOKENS)."""
        out = super().resolve(given)
        cuda = out["device"] == "cuda"
        out["cuda_graphs"] = out.get("cuda_graphs") or ("auto" if cuda else "off")
        if out.get("kv_memory") is None and out.get("max_kv_tokens") is None and not cuda:
            out["max_kv_tokens"] = DEFAULT_MAX_KV_TOKENS
        return out

    def __post_init__(self):
        if self.tp_size < 1 or self.dcp_size < 1 or self.tp_size % self.dcp_size:
            raise ValueError(f"--dcp-size {self.dcp_size} must divide --tp-size {self.tp_size} (both >= 1)")
        self.check_shared()
        capacity.dtype_bytes(self.dtype)
        check(self.dcp_index, DcpIndex, "--dcp-index")
        check(self.kv_cache_dtype, KVCacheDType, "--kv-cache-dtype")
        check(self.dcp_comm, DcpComm, "--dcp-comm")
        check(self.cpu_comm, CpuComm, "--cpu-comm")
        if self.cpu_comm == "shm" and self.nnodes > 1:  # auto: shared memory inside a node, gloo across
            raise ValueError("--cpu-comm shm needs every rank on one host: use auto with --nnodes > 1")
        if self.cuda_graphs not in ("", "auto", *values(Switch)):
            raise ValueError(f"--cuda-graphs must be on or off, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and self.device != "cuda":
            raise ValueError(f"--cuda-graphs on needs --device cuda (device is {self.device})")
        if not self.cuda_graphs:
            raise ValueError(
                "cuda_graphs is empty: give one, or build the config with create() (the device's default)"
            )
        if self.page_size < 1 or self.page_size % self.dcp_size:  # pages are C_d-wide (invariant 4)
            raise ValueError(
                f"--page-size {self.page_size} must be a positive multiple of --dcp-size {self.dcp_size}"
            )
        if self.kv_memory is not None and self.max_kv_tokens is not None:
            raise ValueError("give either --kv-memory or --max-kv-tokens, not both")
        check_gpu_memory_utilization(self.gpu_memory_utilization)
        if self.kv_memory is None and self.max_kv_tokens is None and self.device != "cuda":
            raise ValueError(
                "on cpu the KV pool needs --max-kv-tokens or --kv-memory (create() fills the default)"
            )
        if (self.kv_memory or 1) < 1 or (self.max_kv_tokens or 1) < 1:
            raise ValueError("--kv-memory and --max-kv-tokens must be positive")
        if self.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.transfer_timeout_s <= 0 or self.heartbeat_timeout_s <= 0 or self.transfer_quarantine_s <= 0:
            raise ValueError(
                "--transfer-timeout, --heartbeat-timeout and --transfer-quarantine must be positive"
            )
        if self.data_host in _WILDCARDS:
            raise ValueError(
                f"--data-host {self.data_host!r} is a wildcard: give an address the prefill ranks can "
                "connect to (on Kubernetes, the pod IP)"
            )

    def sized_by_memory(self) -> bool:
        """The ranks size the pool from --gpu-memory-utilization (cuda, no explicit size)."""
        return self.kv_memory is None and self.max_kv_tokens is None

    def num_slots(self) -> int | None:
        """Global KV slots of the instance: whole pages that fit the per-rank budget, or max_kv_tokens
        rounded up; None when the ranks size it from their GPUs' memory (`sized_by_memory`)."""
        if self.sized_by_memory():
            return None
        if self.kv_memory is None:
            return -(-self.max_kv_tokens // self.page_size) * self.page_size
        mcfg = ModelConfig.from_pretrained(self.model)
        slots = capacity.tokens_for_budget(
            mcfg,
            self.kv_memory,
            self.dcp_size,
            self.dcp_index,
            self.page_size,
            self.kv_cache_dtype,
            self.dtype,
        )
        if slots == 0:
            page = capacity.page_bytes_per_rank(
                mcfg, self.dcp_size, self.dcp_index, self.page_size, self.kv_cache_dtype, self.dtype
            )
            raise ValueError(
                f"--kv-memory {self.kv_memory} bytes holds no page ({page} bytes per page per rank)"
            )
        return slots

    def validate_model(self) -> None:
        """Checks that need the checkpoint's config (a clear error before any rank starts)."""
        mcfg = ModelConfig.from_pretrained(self.model)
        if mcfg.num_heads % self.tp_size:
            raise ValueError(
                f"the model's {mcfg.num_heads} attention heads cannot be split over --tp-size {self.tp_size}"
            )
        if self.moe_ep:
            mcfg.experts_per_rank(self.tp_size)
        self.num_slots()
