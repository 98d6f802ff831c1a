"""`pdserve decode`: one process that owns the W rank processes, the decode engine and the HTTP API.

Threads: uvicorn (main thread) runs the HTTP handlers; one engine thread owns the `DecodeEngine`
and is the only code that touches it (the scheduler and allocator are plain Python without locks);
the shared rank watchdog stops the instance, naming the rank, if any rank dies. Handlers talk to
the engine thread through a thread-safe command queue (submit / abort), and the engine thread
answers through per-request callbacks. The first SIGTERM/SIGINT drains (engine/drain.py: new requests
get 503, running ones get --shutdown-grace seconds), then HTTP, the engine thread and the ranks stop.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import uvicorn

from ..engine.auth import require_token
from ..engine.drain import Drain, DrainingServer, install_exit_signals
from ..engine.launcher import LaunchConfig
from ..engine.request import Overloaded, SamplingParams, choice_id
from ..engine.watchdog import start_watchdog, stop_instance
from ..transfer.decode_rooms import DecodeRooms
from ..transfer.frames import DEV_FRAME_KEY, cluster_frame_key
from .config import DEFAULT_MAX_KV_TOKENS, DecodeServerConfig  # noqa: F401 (re-exported)
from .destination import EngineDestination
from .engine import DecodeEngine
from .instance import DecodeInstance
from .rank_worker import DecodeWorkerConfig

IDLE_WAIT_S = 0.1  # how long an idle engine thread blocks on the command queue before re-checking stop
TRANSFER_POLL_S = 0.002  # with nothing to decode, how often pending hand-offs are polled


def build_instance(cfg: DecodeServerConfig) -> DecodeInstance:
    worker = DecodeWorkerConfig(
        cfg.model,
        cfg.num_slots(),
        cfg.dcp_size,
        cfg.dcp_index,
        cfg.dcp_comm,
        cfg.replicate_q_proj,
        cfg.dtype,
        cfg.kv_cache_dtype,
        cpu_comm=cfg.cpu_comm,
        transfer=cfg.transfer,
        data_host=cfg.data_host,
        transfer_quarantine_s=cfg.transfer_quarantine_s,
        frame_key=cluster_frame_key(cfg.internal_token),
        device=cfg.device,
        gpu_ids=cfg.gpu_ids,
        attention_ops=cfg.attention_ops,
        float32_islands=not cfg.exact_dtype,
    )
    launch = LaunchConfig.of_server(cfg, cfg.tp_size)
    return DecodeInstance(worker, launch, page_size=cfg.page_size)


# An event for one request, delivered from the engine thread:
# ("token", id) ... then exactly one of ("finish", reason) or ("error", message).
Listener = Callable[[tuple[str, object]], None]


class Unavailable(RuntimeError):
    """The instance is shutting down: the request was not accepted (HTTP 503)."""


@dataclass
class _Submit:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    listener: Listener
    accepted: Future  # None when queued; ValueError (bad request), Unavailable or another exception otherwise
    bootstrap: str | None = (
        None  # a prefill's side channel: the cache comes by KV hand-off (transfer/decode_rooms.py)
    )


@dataclass
class _Abort:
    request_id: str
    done: Future  # True when the request was live


class EngineLoop:
    """The engine thread. submit(), abort() and stop() are thread-safe; the rest runs on the thread."""

    def __init__(
        self,
        engine: DecodeEngine,
        on_fatal: Callable[[str], None],
        transfer_timeout_s: float = 30.0,
        heartbeat_timeout_s: float = 5.0,
        max_queue: int = 256,
        frame_key: bytes = DEV_FRAME_KEY,
    ):
        self.engine, self.on_fatal, self.max_queue = engine, on_fatal, max_queue
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.listeners: dict[str, Listener] = {}
        self.remote = DecodeRooms(
            EngineDestination(engine), self._emit, transfer_timeout_s, heartbeat_timeout_s, frame_key
        )
        self._stop = threading.Event()
        self._stop_reason = "the decode instance is shutting down"
        self._closed, self._lock = False, threading.Lock()  # once closed, no command can be left unanswered
        self.stats = self._snapshot()  # replaced (never mutated) after every iteration: readers need no lock

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        listener: Listener,
        bootstrap: str | None = None,
    ) -> Future:
        return self._put(_Submit(list(prompt_ids), params, request_id, listener, Future(), bootstrap))

    def abort(self, request_id: str) -> Future:
        return self._put(_Abort(request_id, Future()))

    def _put(self, cmd):
        with self._lock:
            if self._closed:
                _refuse(cmd)
            else:
                self.commands.put(cmd)
        return cmd.accepted if isinstance(cmd, _Submit) else cmd.done

    def busy(self) -> int:
        """Requests accepted or on their way in (thread-safe): a draining server waits for 0."""
        return len(self.listeners) + self.commands.qsize()

    def stop(self, reason: str | None = None) -> None:
        """Ends the thread; requests still live get an error event naming `reason`."""
        if reason:
            self._stop_reason = reason
        self._stop.set()
        self.commands.put(None)  # wakes an idle thread

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                s = self.engine.scheduler
                # idle: sleep on the queue; only waiting for hand-offs: short naps; decoding: don't wait
                self._drain(IDLE_WAIT_S if s.is_idle() else TRANSFER_POLL_S if not s.running else 0.0)
                self.remote.poll()
                if not s.is_idle() or self.engine.pending:  # pending: choices a hand-off started
                    self._dispatch(self.engine.step())  # admits: rooms it admitted are reserved now
                    self.remote.reserve_admitted()
                self.stats = self._snapshot()
        except Exception as e:  # a rank died or the group broke (RankError), or a bug outside any one request
            message = f"decode step failed: {type(e).__name__}: {e}"
            self._fail_all(message)
            if not self._stop.is_set():  # while stopping, the ranks going away is expected
                time.sleep(0.5)  # lets the handlers flush the error to their clients
                self.on_fatal(message)
        with self._lock:
            self._closed = True
        self._fail_all(self._stop_reason)
        self.remote.close()
        while not self.commands.empty():
            cmd = self.commands.get_nowait()
            if cmd is not None:
                _refuse(cmd)

    def _drain(self, wait_s: float) -> None:
        try:
            cmd = self.commands.get(timeout=wait_s) if wait_s > 0 else self.commands.get_nowait()
            while cmd is not None:
                self._handle(cmd)
                cmd = self.commands.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Abort):
            was_remote = self.remote.abort(cmd.request_id)  # tells the prefill, forgets the room on the ranks
            was_local = self.engine.abort(cmd.request_id) is not None  # frees its pages at once
            for rid in self._choices(cmd.request_id):
                _send(self.listeners.pop(rid), ("finish", "abort"))
            cmd.done.set_result(was_remote or was_local)
        elif cmd.request_id in self.listeners:
            cmd.accepted.set_exception(ValueError(f"request id {cmd.request_id!r} is already in use"))
        elif len(self.engine.scheduler.queued) >= self.max_queue:
            cmd.accepted.set_exception(
                Overloaded(f"the decode queue is full ({self.max_queue} requests waiting)")
            )
        elif cmd.bootstrap:
            try:
                self.remote.submit(cmd.request_id, len(cmd.prompt_ids), cmd.params, cmd.bootstrap)
            except Exception as e:
                cmd.accepted.set_exception(e)
                return
            self._listen(cmd.request_id, cmd.params.n, cmd.listener)
            cmd.accepted.set_result(None)
        else:
            try:  # without a cache the engine prefills locally, here on this thread (the KV hand-off replaces it)
                self.engine.submit(cmd.prompt_ids, cmd.params, cmd.request_id)
            except Exception as e:
                self.engine.abort(cmd.request_id)  # a failed local prefill must not leave the request queued
                cmd.accepted.set_exception(e)
                return
            self._listen(cmd.request_id, cmd.params.n, cmd.listener)
            cmd.accepted.set_result(None)

    def _dispatch(self, events) -> None:
        ended = {}
        left = Counter(req.request_id for req, token in events if token is not None)
        for req, token in events:  # a request's end follows all of its tokens of this step
            listener = self.listeners.get(req.request_id)
            if token is not None:
                left[req.request_id] -= 1  # this step's tokens are the request's last ones, in order
            if listener and token is not None:
                _send(listener, ("token", token, req.logprob_wire(left[req.request_id])))
            if req.state == "failed":  # computing it raised: only this request ends (engine.step)
                ended[req.request_id] = ("error", f"decode step failed: {req.error}")
            elif req.state in ("finished", "aborted"):
                ended[req.request_id] = ("finish", req.finish_reason)
        for request_id, event in ended.items():
            listener = self.listeners.pop(request_id, None)
            if listener:
                _send(listener, event)

    def _emit(self, request_id: str, event: tuple[str, object]) -> None:
        """An event from the hand-off path; a finish or an error is the request's last (a failed
        hand-off's error is every choice's: none of them started)."""
        for rid in self._choices(request_id) if event[0] == "error" else [request_id]:
            listener = self.listeners.get(rid)
            if event[0] in ("finish", "error"):
                self.listeners.pop(rid, None)
            if listener:
                _send(listener, event)

    def _listen(self, request_id: str, n: int, listener: Listener) -> None:
        """n > 1: choice i's events reach the request's listener tagged with i (its own id, choice_id)."""
        self.listeners[request_id] = listener
        for i in range(1, n):
            self.listeners[choice_id(request_id, i)] = _tagged(listener, i)

    def _choices(self, request_id: str) -> list[str]:
        """The live listeners of a request's choices (ids never contain "/": choice i's is id/i)."""
        return [rid for rid in self.listeners if rid == request_id or rid.startswith(request_id + "/")]

    def _fail_all(self, message: str) -> None:
        for room in list(self.remote.rooms):
            try:
                self.remote.abort(room)
            except Exception:  # the ranks are gone: nothing left to forget on them
                pass
        for request_id, listener in list(self.listeners.items()):
            self.engine.abort(request_id)
            _send(listener, ("error", message))
        self.listeners.clear()

    def _snapshot(self) -> dict:
        s, alloc = self.engine.scheduler, self.engine.instance.allocator
        return {
            "free_tokens": alloc.num_free * alloc.page_size,
            "held_tokens": alloc.num_held * alloc.page_size,
            "running": len(s.running),
            "queued": len(s.queued) + len(s.waiting_for_kv),
            "transfers_pending": len(self.remote.rooms),
            "transfers_completed": self.remote.completed,
            "transfers_failed": self.remote.failed,
            "transfer_bytes": self.remote.bytes_received,
            "transfer_seconds": self.remote.transfer_seconds,
        }


def _refuse(cmd) -> None:
    if isinstance(cmd, _Submit):
        cmd.accepted.set_exception(Unavailable("the decode instance is shutting down"))
    else:
        cmd.done.set_result(False)


def _tagged(listener: Listener, index: int) -> Listener:
    """Events of choice `index`: (kind, value, logprobs wire, index) (decode http_api._stream)."""
    return lambda ev: listener((ev[0], ev[1], ev[2] if len(ev) > 2 else [], index))


def _send(listener: Listener, event: tuple[str, object]) -> None:
    try:
        listener(event)
    except RuntimeError:  # the handler's event loop is closed (server shutting down): nobody to tell
        pass


def serve(cfg: DecodeServerConfig) -> None:
    import torch

    from .http_api import create_app

    install_exit_signals()  # during startup a signal exits through the `finally` below, stopping the ranks
    torch.set_num_threads(cfg.threads_per_rank)  # the local prefill must not take the ranks' cores
    require_token(cfg.internal_token)
    cfg.validate_model()
    instance = build_instance(cfg)
    print(
        f"starting {cfg.tp_size} decode rank(s) (DCP {cfg.dcp_size}) for {cfg.model}",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    loop: EngineLoop | None = None
    thread: threading.Thread | None = None
    try:
        instance.start()
        loop = EngineLoop(
            DecodeEngine(instance, cfg.max_batch),
            lambda msg: stop_instance(instance, "decode", msg),
            cfg.transfer_timeout_s,
            cfg.heartbeat_timeout_s,
            cfg.max_queue,
            cluster_frame_key(cfg.internal_token),
        )
        thread = threading.Thread(target=loop.run, name="decode-engine", daemon=True)
        thread.start()
        start_watchdog(instance, "decode", stop)
        drain = Drain("decode", cfg.shutdown_grace_s, loop.busy)
        app = create_app(
            cfg, instance, loop, lambda: instance.ranks.unhealthy() or loop.remote.unhealthy(), drain
        )
        config = uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5
        )
        DrainingServer(config, drain, on_exit=loop.stop).run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not interrupt the shutdown
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        if loop:
            loop.stop()
        if thread:  # finish the current step before the ranks go away under it
            thread.join(timeout=10)
        instance.shutdown()
