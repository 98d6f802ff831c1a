"""`pdserve prefill`: one process that owns the C_p rank processes, the prefill loop and the HTTP API.

Startup: spawn the C_p ranks and wait for every readiness ack, then serve HTTP. The threads, the
command queue, the watchdog (a dead rank stops the instance, exit 1, never a hang in a collective)
and the shutdown are the skeleton both roles share (serving/instance_loop.py); prefill_server/loop.py
is this role's loop thread. The hand-off side channel (BootstrapService) runs in its own thread.
"""

from __future__ import annotations

import sys

from ..runtime.launcher import LaunchConfig
from ..runtime.nodes import apply_interfaces, describe_nodes
from ..serving.auth import require_token
from ..serving.instance_loop import serve_instance
from ..serving.watchdog import stop_instance
from ..transfer.frames import cluster_frame_key
from ..transfer.side_channel import BootstrapService
from .config import PrefillServerConfig
from .http_api import create_app
from .instance import PrefillInstance
from .loop import PrefillLoop
from .worker_config import PrefillWorkerConfig


def build_instance(cfg: PrefillServerConfig) -> PrefillInstance:
    worker, launch = PrefillWorkerConfig.of_server(cfg), LaunchConfig.of_server(cfg, cfg.cp_size)
    return PrefillInstance(
        worker,
        launch,
        page_size=cfg.page_size,
        chunk_size=cfg.chunk_size,
        prefix_cache=cfg.prefix_cache == "on",
        stream_handoff=cfg.handoff_stream == "on",
    )


def serve(cfg: PrefillServerConfig) -> None:
    require_token(cfg.internal_token)
    cfg.validate_model()
    apply_interfaces(cfg)  # before any rank starts: they inherit it (runtime/nodes.py)
    instance = build_instance(cfg)
    print(
        f"starting {cfg.cp_size} prefill rank(s){describe_nodes(cfg)} for {cfg.model}",
        file=sys.stderr,
        flush=True,
    )

    def make_loop() -> PrefillLoop:
        # the hand-off side channel (own thread: heartbeats); decode instances connect. Its frames are signed with
        # the key of cfg.internal_token (transfer/frames.cluster_frame_key); unhealthy() names a dead thread.
        bootstrap = BootstrapService(cfg.host, cluster_frame_key(cfg.internal_token))
        return PrefillLoop(
            instance, bootstrap, cfg.max_queue, lambda msg: stop_instance(instance, "prefill", msg)
        )

    def make_app(loop: PrefillLoop, drain):
        dead = lambda: instance.ranks.unhealthy() or loop.bootstrap.unhealthy()  # noqa: E731
        return create_app(instance, loop, dead, cfg.bootstrap_timeout_s, drain, cfg.internal_token)

    serve_instance(cfg, instance, make_loop, make_app)
