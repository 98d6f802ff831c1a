"""`pdserve prefill` and `pdserve decode`: one instance of each role, behind its HTTP API.

Their options are the option fields of `PrefillServerConfig` / `DecodeServerConfig`
(pdserve/flags.py); a command declares only what is not a config field (--internal-token-file,
--gpu-memory, --check-config) and what needs more than a copy into the config."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import typer

from ..decode_server.config import DecodeServerConfig
from ..flags import config_command
from ..prefill_server.config import PrefillServerConfig
from ..runtime.launcher import prestart
from ..runtime.nodes import lws_values
from .admin import parse_bytes
from .common import (
    InternalTokenFileOpt,
    app,
    check_gpus,
    fail,
    gpu_ids_value,
    internal_token,
    masked,
    model_arg,
)

_CHECK_HELP = (
    "Validate the flags and the checkpoint (config.json alone is enough), print the config{} plan "
    "(topology, weight and KV bytes per rank) as JSON, and exit without starting."
)


def _server_values(values: dict, token_file, check_config: bool) -> dict:
    """The values that need more than a copy: the model (--check-config never builds one), the token."""
    values["model"] = str(model_arg(values["model"], check_config))
    values["internal_token"] = internal_token(values["internal_token"], token_file, check_config)
    values["gpu_ids"] = gpu_ids_value(values["gpu_ids"])
    values["dtype"] = values["dtype"] or ""  # the device's default (runtime/placement.py)
    return lws_values(values)  # --nnodes, --node-rank, --dist-addr: the flags, else a LeaderWorkerSet's


def _node_agent(cfg, role: str) -> bool:
    """Runs this node's agent (runtime/node_agent.py) when it is not node 0; False on node 0."""
    if cfg.node_rank == 0:
        return False
    from ..runtime.node_agent import serve_agent
    from ..serving.auth import require_token
    from ..transfer.frames import cluster_frame_key

    require_token(cfg.internal_token)
    serve_agent(cfg, role, cluster_frame_key(cfg.internal_token))
    return True


@app.command()
@config_command(PrefillServerConfig)
def prefill(
    values: dict,
    internal_token_file: InternalTokenFileOpt = None,
    check_config: bool = typer.Option(False, "--check-config", help=_CHECK_HELP.format(" and its")),
):
    """Run a prefill instance: C_p rank processes with context parallelism, behind an HTTP control API."""
    try:
        cfg = PrefillServerConfig.create(**_server_values(values, internal_token_file, check_config))
        cfg.validate_model()
        if not check_config:
            prestart(cfg.device)  # the ranks' forkserver imports torch while this process does
            check_gpus(cfg, cfg.cp_size)
        if check_config:
            from .check_plan import echo_plan, prefill_plan

            plan = prefill_plan(
                cfg.model, cfg.cp_size, cfg.cache, cfg.moe_tp, cfg.dtype, cfg.num_slots, cfg.moe_ep
            )
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if check_config:
        echo_plan(masked(asdict(cfg)), plan)
        return
    if _node_agent(cfg, "prefill"):
        return
    from ..prefill_server.serve import serve

    serve(cfg)


@app.command()
@config_command(DecodeServerConfig)
def decode(
    values: dict,
    internal_token_file: InternalTokenFileOpt = None,
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="With --check-config: memory of one GPU, e.g. 141GiB; adds whether this instance fits one GPU per rank and, per C_d, the fewest ranks that hold the weights and the KV tokens they leave room for.",
    ),
    check_config: bool = typer.Option(
        False, "--check-config", help=_CHECK_HELP.format(" with its num_slots and")
    ),
):
    """Run a decode instance: W rank processes with tensor + decode context parallelism, behind an HTTP API."""
    try:
        if values["kv_memory"] is not None:
            values["kv_memory"] = parse_bytes(values["kv_memory"])
        values["cuda_graphs"] = values["cuda_graphs"] or ""  # on where it can run with --device cuda
        cfg = DecodeServerConfig.create(**_server_values(values, internal_token_file, check_config))
        cfg.validate_model()
        if not check_config:
            prestart(cfg.device)  # the ranks' forkserver imports torch while this process does
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
                keep_fp8=cfg.device == "cuda" and not cfg.dequantize,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                moe_ep=cfg.moe_ep,
            )
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if check_config:
        echo_plan(masked({**asdict(cfg), "num_slots": num_slots}), plan)
        return
    if _node_agent(cfg, "decode"):
        return
    from ..decode_server.serve import serve

    serve(cfg)
