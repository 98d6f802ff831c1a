"""`DecodeWorkerConfig`: what every decode rank is told at start, derived from the instance's
DecodeServerConfig in one place (`of_server`); tests and benches build it directly. The choices are
checked against the same sets (choices.py) as the server's flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..choices import CpuComm, DcpComm, DcpIndex, Transfer, check
from ..runtime.memory_check import DEFAULT_GPU_MEMORY_UTILIZATION, check_gpu_memory_utilization
from ..transfer.frames import DEV_FRAME_KEY, cluster_frame_key


@dataclass(frozen=True)
class DecodeWorkerConfig:
    model_dir: str
    # global slots of the instance (each rank stores num_slots / dcp_size rows); None on cuda: the
    # ranks size it from gpu_memory_utilization of their GPUs' memory, in pages of page_size
    num_slots: int | None
    dcp_size: int = 1
    index_mode: str = "copy"
    comm: str = "a2a"
    replicate_q: bool = False
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    float32_islands: bool = True
    cpu_comm: str = "auto"  # collectives between the ranks: shared memory or gloo (runtime/comm.py)
    nnodes: int = 1  # hosts the W ranks span (W / nnodes each): shared memory only inside one
    device: str = "cpu"  # "cuda": the GPU the launcher selected for this rank (runtime/device.py)
    gpu_ids: tuple[int, ...] = ()  # the instance's GPUs (they decide NCCL or the host comm)
    attention_ops: str = "auto"  # engine/attn_ops.py
    linear_ops: str = "auto"  # engine/gemm_ops.py
    moe_ops: str = "auto"
    moe_ep: bool = False  # routed experts by id across the W ranks (runtime/expert_parallel.py)
    max_batch: int = 64  # --max-batch: the largest batch bucket (decode_server/step_metadata.py)
    cuda_graphs: str = "off"  # on | off | auto (cuda's default): decode_server/cuda_graphs.py
    forbid_host_sync: bool = False  # tests: the step raises on any host sync (runtime/sync_check.py)
    pad_steps: bool | None = None  # steps in bucket shapes with padding rows (None: on cuda; tests: cpu)
    keep_fp8: bool = False  # fp8 checkpoint weights stay fp8 (model/shard.py): cuda without --dequantize
    transfer: str = "tcp"  # KV hand-off data path: "tcp" | "nixl"
    data_host: str = "127.0.0.1"  # address the TCP receivers bind and advertise to prefill ranks
    transfer_quarantine_s: float = (
        60.0  # NIXL: a failed room's pages stay unused this long (senders may write)
    )
    # data frames must be signed with it (transfer/frames.py)
    frame_key: bytes = field(default=DEV_FRAME_KEY, repr=False)
    page_size: int = 64
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    def __post_init__(self):
        check(self.transfer, Transfer, "--transfer")
        check(self.index_mode, DcpIndex, "--dcp-index")
        check(self.comm, DcpComm, "--dcp-comm")
        check(self.cpu_comm, CpuComm, "--cpu-comm")
        if self.dcp_size < 1 or (self.num_slots or 0) % self.dcp_size:
            raise ValueError(f"num_slots {self.num_slots} must be a multiple of --dcp-size {self.dcp_size}")
        if self.num_slots is None and self.device != "cuda":
            raise ValueError("the KV pool is sized from GPU memory only with --device cuda")
        check_gpu_memory_utilization(self.gpu_memory_utilization)

    @classmethod
    def of_server(cls, cfg) -> "DecodeWorkerConfig":
        """Every rank's config, from the instance's DecodeServerConfig (the one place it is derived)."""
        return cls(
            cfg.model,
            cfg.num_slots(),
            cfg.dcp_size,
            cfg.dcp_index,
            cfg.dcp_comm,
            cfg.replicate_q_proj,
            cfg.dtype,
            cfg.kv_cache_dtype,
            cpu_comm=cfg.cpu_comm,
            nnodes=cfg.nnodes,
            transfer=cfg.transfer,
            data_host=cfg.data_host,
            transfer_quarantine_s=cfg.transfer_quarantine_s,
            frame_key=cluster_frame_key(cfg.internal_token),
            device=cfg.device,
            gpu_ids=cfg.gpu_ids,
            attention_ops=cfg.attention_ops,
            linear_ops=cfg.linear_ops,
            moe_ops=cfg.moe_ops,
            moe_ep=cfg.moe_ep,
            max_batch=cfg.max_batch,
            cuda_graphs=cfg.cuda_graphs,
            keep_fp8=cfg.device == "cuda" and not cfg.dequantize,
            float32_islands=not cfg.exact_dtype,
            page_size=cfg.page_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
        )
