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
from dataclasses import dataclass, field

from ..engine.auth import require_token
from ..engine.device import check_device_fields
from ..engine.drain import Drain, DrainingServer, install_exit_signals
from ..engine.launcher import LaunchConfig
from ..engine.watchdog import start_watchdog
from ..transfer.backends import check_transfer
from ..transfer.frames import cluster_frame_key
from ..transfer.side_channel import BootstrapService
from .instance import PrefillInstance
from .layouts import check_layout_allowed
from .rank_worker import CACHE_MODES, PrefillWorkerConfig
from .scheduler import PrefillScheduler


@dataclass(frozen=True)
class PrefillServerConfig:
    model: str
    cp_size: int = 1
    cp_layout: str = "interleave"
    cache: str = "full"
    chunk_size: int = 4096
    moe_tp: bool = False
    host: str = "127.0.0.1"
    port: int = 8100
    dist_port: int = 29500
    dtype: str = ""  # "": float32 on cpu, bfloat16 on cuda (engine/device.py)
    max_kv_tokens: int = 65536
    page_size: int = 16
    threads_per_rank: int = 1
    shutdown_grace_s: float = 30.0  # SIGTERM: running requests get this long to finish (engine/drain.py)
    internal_token: str | None = field(default=None, repr=False)  # engine/auth.py; serve() requires one
    bootstrap_timeout_s: float = 30.0  # a hand-off request fails when no decode reservation came by then
    transfer: str = "tcp"  # KV hand-off data path: tcp | nixl
    kv_residues: int = 0  # residue-major latent cache (KVPool); 0: cp_size
    max_queue: int = 256  # waiting requests beyond this many get 429
    device: str = "cpu"  # cpu | cuda (engine/device.py)
    gpu_ids: tuple[int, ...] = ()  # cuda: rank r uses gpu_ids[r] (default r)
    attention_ops: str = "auto"  # auto | torch | flashinfer (engine/attn_ops.py)

    def __post_init__(self):
        if self.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {self.max_queue}")
        if self.kv_residues < 0:
            raise ValueError(f"--kv-residues must be >= 0 (0: the CP size), got {self.kv_residues}")
        if self.cp_size < 1:
            raise ValueError(f"--cp-size must be >= 1, got {self.cp_size}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"--cache must be one of {', '.join(CACHE_MODES)}, got {self.cache!r}")
        if self.chunk_size < 1 or self.max_kv_tokens < self.page_size:
            raise ValueError("--chunk-size must be >= 1 and --max-kv-tokens at least one page")
        if self.port == self.dist_port:
            raise ValueError("--port and --dist-port must differ")
        if self.bootstrap_timeout_s <= 0:
            raise ValueError("--bootstrap-timeout must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}")
        check_transfer(self.transfer)
        check_device_fields(self, self.cp_size)

    def validate_model(self) -> None:
        """Checks that need the checkpoint's config (a clear error before any rank starts)."""
        from ..model.config import ModelConfig

        check_layout_allowed(ModelConfig.from_pretrained(self.model).model_type, self.cp_layout)

    def build_instance(self) -> PrefillInstance:
        num_slots = -(-self.max_kv_tokens // self.page_size) * self.page_size
        worker = PrefillWorkerConfig(
            self.model,
            num_slots,
            self.dtype,
            self.cp_layout,
            self.cache,
            self.moe_tp,
            transfer=self.transfer,
            kv_residues=self.kv_residues or self.cp_size,
            frame_key=cluster_frame_key(self.internal_token),
            device=self.device,
            attention_ops=self.attention_ops,
        )
        launch = LaunchConfig(
            self.cp_size,
            self.dist_port,
            threads_per_rank=self.threads_per_rank,
            device=self.device,
            gpu_ids=self.gpu_ids,
        )
        return PrefillInstance(worker, launch, page_size=self.page_size, chunk_size=self.chunk_size)


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
        if not ran and scheduler.waiting:
            time.sleep(0.01)  # waiting for pages held by hand-offs in flight


def serve(cfg: PrefillServerConfig) -> None:
    import uvicorn

    from .http_api import create_app

    require_token(cfg.internal_token)
    cfg.validate_model()
    instance = cfg.build_instance()
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
