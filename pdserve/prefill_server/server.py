"""`pdserve prefill`: one process that owns the rank processes, the scheduler and the HTTP API.

Startup: spawn the C_p ranks and wait for every readiness ack, then serve HTTP. A watchdog
thread checks the ranks; if any dies, the instance logs which one, stops every other rank and
exits with status 1 (it never hangs in a collective). The first SIGTERM/SIGINT drains (engine/drain.py:
new requests get 503, running ones get --shutdown-grace seconds), then everything shuts down, exit 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from ..engine.auth import require_token
from ..engine.drain import Drain, DrainingServer, install_exit_signals
from ..engine.launcher import LaunchConfig
from ..engine.watchdog import start_watchdog
from ..transfer.frames import cluster_frame_key
from ..transfer.side_channel import BootstrapService
from .config import PrefillServerConfig
from .instance import PrefillInstance
from .rank_worker import PrefillWorkerConfig
from .scheduler import PrefillScheduler


def build_instance(cfg: PrefillServerConfig) -> PrefillInstance:
    worker = PrefillWorkerConfig(
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
        float32_islands=not cfg.exact_dtype,
    )
    launch = LaunchConfig.of_server(cfg, cfg.cp_size)
    return PrefillInstance(worker, launch, page_size=cfg.page_size, chunk_size=cfg.chunk_size)


log = logging.getLogger("pdserve.prefill")


def _worker_loop(scheduler: PrefillScheduler, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            ran = scheduler.run_once()
        except (
            Exception
        ) as e:  # a bug must cost the request at hand, never the thread that serves all of them
            log.exception("prefill worker: unexpected error")
            scheduler.fail_current(f"internal error: {type(e).__name__}: {e}")
            continue
        if not ran and scheduler.blocked_on_pages:
            time.sleep(0.01)  # waiting for pages held by hand-offs in flight


def serve(cfg: PrefillServerConfig) -> None:
    import uvicorn

    from .http_api import create_app

    require_token(cfg.internal_token)
    cfg.validate_model()
    instance = build_instance(cfg)
    print(f"starting {cfg.cp_size} prefill rank(s) for {cfg.model}", file=sys.stderr, flush=True)
    instance.start()
    # the hand-off side channel (own thread: heartbeats); decode instances connect. Its frames are signed with the
    # key of cfg.internal_token (transfer/frames.cluster_frame_key); bootstrap.unhealthy() names a dead thread.
    bootstrap = BootstrapService(cfg.host, cluster_frame_key(cfg.internal_token))
    scheduler = PrefillScheduler(instance, bootstrap, cfg.max_queue)
    stop = threading.Event()
    worker = threading.Thread(target=_worker_loop, args=(scheduler, stop), daemon=True)
    worker.start()
    start_watchdog(instance, "prefill", stop)
    install_exit_signals()  # a signal uvicorn re-raises after it stopped must still run the `finally` below
    drain = Drain("prefill", cfg.shutdown_grace_s, lambda: scheduler.queue_depth)
    app = create_app(
        instance,
        scheduler,
        lambda: instance.ranks.unhealthy() or bootstrap.unhealthy(),
        cfg.bootstrap_timeout_s,
        drain,
        cfg.internal_token,
    )
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5
    )
    try:
        DrainingServer(config, drain, on_exit=scheduler.stop).run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not interrupt the shutdown
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        scheduler.stop()
        worker.join(timeout=10)  # it may still be answering a room through the service
        bootstrap.close()
        instance.shutdown()
