"""`pdserve decode`: one process that owns the W rank processes, the decode loop and the HTTP API.

The threads, the command queue and the shutdown are the skeleton both roles share
(serving/instance_loop.py); decode_server/loop.py is this role's loop thread.
"""

from __future__ import annotations

import sys

from ..runtime.launcher import LaunchConfig
from ..runtime.nodes import apply_interfaces, describe_nodes
from ..serving.auth import require_token
from ..serving.instance_loop import serve_instance
from ..serving.watchdog import stop_instance
from ..transfer.frames import cluster_frame_key
from .config import DecodeServerConfig
from .http_api import create_app
from .instance import DecodeInstance
from .loop import DecodeLoop
from .step_driver import DecodeStepDriver
from .worker_config import DecodeWorkerConfig


def build_instance(cfg: DecodeServerConfig) -> DecodeInstance:
    worker, launch = DecodeWorkerConfig.of_server(cfg), LaunchConfig.of_server(cfg, cfg.tp_size)
    return DecodeInstance(worker, launch, page_size=cfg.page_size, prefix_cache=cfg.prefix_cache == "on")


def serve(cfg: DecodeServerConfig) -> None:
    import torch

    torch.set_num_threads(cfg.threads_per_rank)  # the local prefill must not take the ranks' cores
    require_token(cfg.internal_token)
    cfg.validate_model()
    apply_interfaces(cfg)  # before any rank starts: they inherit it (runtime/nodes.py)
    instance = build_instance(cfg)
    print(
        f"starting {cfg.tp_size} decode rank(s) (DCP {cfg.dcp_size}){describe_nodes(cfg)} for {cfg.model}",
        file=sys.stderr,
        flush=True,
    )

    def make_loop() -> DecodeLoop:
        return DecodeLoop(
            DecodeStepDriver(instance, cfg.max_batch),
            lambda msg: stop_instance(instance, "decode", msg),
            cfg.transfer_timeout_s,
            cfg.heartbeat_timeout_s,
            cfg.max_queue,
            cluster_frame_key(cfg.internal_token),
        )

    def make_app(loop: DecodeLoop, drain):
        dead = lambda: instance.ranks.unhealthy() or loop.remote.unhealthy()  # noqa: E731
        return create_app(cfg, instance, loop, dead, drain)

    serve_instance(cfg, instance, make_loop, make_app)
