"""`pdserve prefill` and `pdserve decode`: one instance of each role, behind its HTTP API."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from .admin_cli import KVCacheDType, parse_bytes
from .admin_cli import ModelDType as DType
from .cli_common import (
    DTYPE_HELP,
    AttentionOpsOpt,
    DcpIndex,
    DeviceOpt,
    GpuIdsOpt,
    InternalTokenFileOpt,
    InternalTokenOpt,
    ModelOpt,
    ShutdownGraceOpt,
    Transfer,
    app,
    check_gpus,
    device_args,
    fail,
    internal_token,
    masked,
    model_arg,
)


class Layout(str, Enum):
    interleave = "interleave"
    zigzag = "zigzag"
    contiguous = "contiguous"


class CacheMode(str, Enum):
    full = "full"
    layer_split = "layer-split"


@app.command()
def prefill(
    model: ModelOpt = None,
    cp_size: int = typer.Option(
        1, min=1, help="Context-parallel ranks C_p: the prompt's tokens are split across them."
    ),
    cp_layout: Layout = typer.Option(
        Layout.interleave,
        help="Token layout: interleave (token p on rank p % C_p; the only one for sparse-attention models), zigzag (2*C_p blocks, for dense models), contiguous (comparison only).",
    ),
    cache: CacheMode = typer.Option(
        CacheMode.full,
        help="full: every rank keeps every layer's cache; layer-split: each rank keeps a contiguous block of layers.",
    ),
    chunk_size: int = typer.Option(
        4096,
        min=1,
        help="Prompt tokens per prefill chunk; each chunk is split across the ranks, earlier chunks are read from the cache.",
    ),
    moe_tp: bool = typer.Option(
        False,
        "--moe-tp",
        help="Split MLP/MoE weights across the ranks (all-gather tokens, reduce-scatter outputs) instead of replicating them.",
    ),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP control API listens on."),
    port: int = typer.Option(8100, help="Port of the HTTP control API."),
    dist_port: int = typer.Option(
        29500, help="TCP port the ranks use to form their torch.distributed group."
    ),
    dtype: Optional[DType] = typer.Option(None, help=DTYPE_HELP),
    device: DeviceOpt = "cpu",
    gpu_ids: GpuIdsOpt = None,
    attention_ops: AttentionOpsOpt = "auto",
    max_kv_tokens: int = typer.Option(
        65536, min=16, help="KV cache capacity in tokens (per rank, every rank holds the same slots)."
    ),
    threads_per_rank: int = typer.Option(1, min=1, help="torch threads in each rank process."),
    bootstrap_timeout: float = typer.Option(
        30.0,
        help="Seconds a hand-off request waits for its decode instance's page reservation before it fails.",
    ),
    transfer: Transfer = typer.Option(
        Transfer.tcp,
        help="KV hand-off data path to decode instances: tcp (ZMQ over TCP) or nixl (NIXL/UCX one-sided WRITEs; RDMA or NVLink where present). Both sides must use the same.",
    ),
    max_queue: int = typer.Option(
        256,
        min=1,
        help="Requests waiting to be prefilled beyond this many are refused with 429 and Retry-After (bounded admission; the router then tries another instance).",
    ),
    kv_residues: int = typer.Option(
        0,
        min=0,
        help="Store each layer's latent cache residue-major by R residues (slot s at row (s % R) * ceil(slots / R) + s // R), so each rank of a decode instance with C_d = R finds its tokens in contiguous rows, which --transfer nixl WRITEs straight from the cache without packing. 0 (default): the CP size. Any value works with any decode instance; only the packing cost differs.",
    ),
    shutdown_grace: ShutdownGraceOpt = 30.0,
    internal_token_: InternalTokenOpt = None,
    internal_token_file: InternalTokenFileOpt = None,
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags and the checkpoint (config.json alone is enough), print the config and its plan (topology, weight and KV bytes per rank) as JSON, and exit without starting.",
    ),
):
    """Run a prefill instance: C_p rank processes with context parallelism, behind an HTTP control API."""
    from dataclasses import asdict

    from .prefill_server.server import PrefillServerConfig, serve

    try:
        cfg = PrefillServerConfig(
            shutdown_grace_s=shutdown_grace,
            internal_token=internal_token(internal_token_, internal_token_file, check_config),
            model=str(model_arg(model, check_config)),
            cp_size=cp_size,
            cp_layout=cp_layout.value,
            cache=cache.value,
            chunk_size=chunk_size,
            moe_tp=moe_tp,
            host=host,
            port=port,
            dist_port=dist_port,
            dtype=dtype.value if dtype else "",
            max_kv_tokens=max_kv_tokens,
            threads_per_rank=threads_per_rank,
            bootstrap_timeout_s=bootstrap_timeout,
            transfer=transfer.value,
            kv_residues=kv_residues,
            max_queue=max_queue,
            attention_ops=attention_ops.value,
            **device_args(device, gpu_ids),
        )
        cfg.validate_model()
        if not check_config:
            check_gpus(cfg, cfg.cp_size)
        if check_config:
            from .check_plan import echo_plan, prefill_plan

            slots = -(-cfg.max_kv_tokens // cfg.page_size) * cfg.page_size
            plan = prefill_plan(cfg.model, cfg.cp_size, cfg.cache, cfg.moe_tp, cfg.dtype, slots)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if check_config:
        echo_plan(masked(asdict(cfg)), plan)
        return
    serve(cfg)


class DcpComm(str, Enum):
    a2a = "a2a"
    ag_rs = "ag_rs"


class CpuComm(str, Enum):
    auto = "auto"
    shm = "shm"
    gloo = "gloo"


@app.command()
def decode(
    model: ModelOpt = None,
    tp_size: int = typer.Option(
        1, min=1, help="Decode ranks W: attention heads are split across them (tensor parallel)."
    ),
    dcp_size: int = typer.Option(
        1,
        min=1,
        help="Decode context-parallel size C_d (must divide --tp-size): each group of C_d ranks splits the KV cache by token.",
    ),
    dcp_index: DcpIndex = typer.Option(
        DcpIndex.copy,
        help="Sparse-attention index keys: copy (every rank keeps all) or split (by token like the cache; ranks merge top-k candidates).",
    ),
    dcp_comm: DcpComm = typer.Option(
        DcpComm.a2a,
        help="How partial attention results are merged: a2a (all-to-all) or ag_rs (all-gather + reduce-scatter).",
    ),
    replicate_q_proj: bool = typer.Option(
        False,
        "--replicate-q-proj",
        help="Each rank keeps the query projection for every head slice of its DCP group, so queries need no all-gather (more weight memory).",
    ),
    kv_cache_dtype: KVCacheDType = typer.Option(
        KVCacheDType.auto,
        help="KV cache storage: auto (the model dtype) or fp8_e4m3 (1 byte per value, index keys with a float32 scale).",
    ),
    kv_memory: Optional[str] = typer.Option(
        None,
        help="KV cache budget per rank, e.g. 80GiB, 512MiB or plain bytes; sets the token capacity (instead of --max-kv-tokens).",
    ),
    max_kv_tokens: Optional[int] = typer.Option(
        None,
        min=1,
        help="KV cache capacity in tokens of the whole instance, rounded up to whole pages (default 65536 unless --kv-memory is given).",
    ),
    page_size: int = typer.Option(
        64, min=1, help="KV slots per page; must be a multiple of --dcp-size (pages are C_d-wide)."
    ),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP API listens on."),
    port: int = typer.Option(8200, help="Port of the HTTP API."),
    dist_port: int = typer.Option(
        29600, help="TCP port the ranks use to form their torch.distributed group."
    ),
    dtype: Optional[DType] = typer.Option(
        None,
        help="Weights and activations dtype (and KV cache dtype when --kv-cache-dtype is auto). Default: float32 on cpu, bfloat16 on cuda.",
    ),
    device: DeviceOpt = "cpu",
    gpu_ids: GpuIdsOpt = None,
    attention_ops: AttentionOpsOpt = "auto",
    threads_per_rank: int = typer.Option(
        1, min=1, help="torch threads in each rank process (and in the server's local prefill)."
    ),
    max_batch: int = typer.Option(
        64, min=1, help="Most requests decoded together in one step (continuous batching)."
    ),
    max_queue: int = typer.Option(
        256,
        min=1,
        help="Accepted requests waiting for KV pages beyond this many are refused with 429 and Retry-After (bounded admission).",
    ),
    cpu_comm: CpuComm = typer.Option(
        CpuComm.auto,
        help="Collectives between CPU ranks: shm (shared memory, ~15 us each), gloo (loopback TCP, ~0.5 ms each) or auto (shm on x86).",
    ),
    transfer_timeout: float = typer.Option(
        30.0,
        help="Seconds a hand-off request waits for the prefill's rows after its pages were reserved before it fails.",
    ),
    heartbeat_timeout: float = typer.Option(
        5.0,
        help="Seconds of silence (no heartbeat) from a prefill instance after which its hand-offs in flight fail (it died).",
    ),
    data_host: str = typer.Option(
        "127.0.0.1",
        help="Address the ranks' TCP receivers (--transfer tcp) listen on and advertise to prefill ranks; on a cluster, this host's address that prefill hosts can reach (e.g. the pod IP).",
    ),
    transfer: Transfer = typer.Option(
        Transfer.tcp,
        help="KV hand-off data path from prefill instances: tcp (ZMQ over TCP) or nixl (NIXL/UCX one-sided WRITEs). Both sides must use the same.",
    ),
    shutdown_grace: ShutdownGraceOpt = 30.0,
    transfer_quarantine: float = typer.Option(
        60.0,
        help="--transfer nixl: seconds the pages of a hand-off that failed while its prefill may still be sending stay out of use (NIXL WRITEs land in the cache itself; a late one must not reach another request).",
    ),
    internal_token_: InternalTokenOpt = None,
    internal_token_file: InternalTokenFileOpt = None,
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="With --check-config: memory of one GPU, e.g. 141GiB; adds whether this instance fits one GPU per rank and, per C_d, the fewest ranks that hold the weights and the KV tokens they leave room for.",
    ),
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags and the checkpoint (config.json alone is enough), print the config with its num_slots and plan (topology, weight and KV bytes per rank) as JSON, and exit without starting.",
    ),
):
    """Run a decode instance: W rank processes with tensor + decode context parallelism, behind an HTTP API."""
    from dataclasses import asdict

    from .decode_server.server import DEFAULT_MAX_KV_TOKENS, DecodeServerConfig, serve

    if kv_memory is not None and max_kv_tokens is not None:
        fail("give either --kv-memory or --max-kv-tokens, not both")
    try:
        budget = parse_bytes(kv_memory) if kv_memory is not None else None
        cfg = DecodeServerConfig(
            model=str(model_arg(model, check_config)),
            tp_size=tp_size,
            dcp_size=dcp_size,
            shutdown_grace_s=shutdown_grace,
            internal_token=internal_token(internal_token_, internal_token_file, check_config),
            dcp_index=dcp_index.value,
            dcp_comm=dcp_comm.value,
            replicate_q_proj=replicate_q_proj,
            kv_cache_dtype=kv_cache_dtype.value,
            kv_memory=budget,
            max_kv_tokens=DEFAULT_MAX_KV_TOKENS
            if budget is None and max_kv_tokens is None
            else max_kv_tokens,
            page_size=page_size,
            host=host,
            port=port,
            dist_port=dist_port,
            dtype=dtype.value if dtype else "",
            threads_per_rank=threads_per_rank,
            max_batch=max_batch,
            attention_ops=attention_ops.value,
            **device_args(device, gpu_ids),
            cpu_comm=cpu_comm.value,
            transfer_timeout_s=transfer_timeout,
            transfer=transfer.value,
            heartbeat_timeout_s=heartbeat_timeout,
            data_host=data_host,
            transfer_quarantine_s=transfer_quarantine,
            max_queue=max_queue,
        )
        cfg.validate_model()
        if not check_config:
            check_gpus(cfg, cfg.tp_size)
        num_slots = cfg.num_slots()
        if check_config:
            from .check_plan import decode_plan, echo_plan

            plan = decode_plan(
                cfg.model,
                cfg.tp_size,
                cfg.dcp_size,
                cfg.dcp_index,
                cfg.replicate_q_proj,
                cfg.dtype,
                cfg.kv_cache_dtype,
                cfg.page_size,
                num_slots,
                parse_bytes(gpu_memory) if gpu_memory is not None else None,
            )
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if check_config:
        echo_plan(masked({**asdict(cfg), "num_slots": num_slots}), plan)
        return
    serve(cfg)
