"""The server skeleton both roles share: the loop thread that alone owns an instance, and serve().

Threads of a `pdserve prefill` or `pdserve decode` process: uvicorn (main thread) runs the HTTP
handlers; one loop thread owns the instance and its scheduler and is the only code that touches
them (the scheduler and allocator are plain Python without locks); the shared rank watchdog stops
the instance, naming the rank, if any rank dies. Handlers talk to the loop thread through a
thread-safe command queue (submit / abort): a submit's Future says whether the request was accepted
(ValueError: 400, Overloaded: 429, Unavailable: 503), and the loop thread then delivers the
request's events (typed: `Token`, `Finished`, `Failed`, below) through its listener:

    Token(id) ... then exactly one of Finished(reason) or Failed(message).

The first SIGTERM/SIGINT drains (serving/drain.py: new requests get 503, running ones get
--shutdown-grace seconds), then HTTP, the loop thread and the ranks stop.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from .drain import Drain, DrainingServer, install_exit_signals
from .http_server import server_config
from .watchdog import start_watchdog

IDLE_WAIT_S = 0.1  # how long an idle loop thread blocks on the command queue before re-checking stop


@dataclass(frozen=True)
class Token:
    """One token of choice `index`; logprobs: its logprob entry in the wire form ([] when not asked)."""

    token: int
    logprobs: list = field(default_factory=list)
    index: int = 0


@dataclass(frozen=True)
class Finished:
    """Choice `index` ended: reason "length", "stop" or "abort". The request's last event."""

    reason: str
    index: int = 0


@dataclass(frozen=True)
class Failed:
    """The request failed (its last event). instance_failed: the instance failed, not the request (a
    rank died, the loop stopped): the decode stream says `lost` (contracts.ErrorEvent) and the router
    may run the request elsewhere."""

    message: str
    instance_failed: bool = False
    index: int = 0


Event = Token | Finished | Failed
Listener = Callable[[Event], None]


class Unavailable(RuntimeError):
    """The instance is shutting down: the request was not accepted (HTTP 503)."""


@dataclass
class Submit:
    request_id: str
    listener: Listener
    payload: object  # what the role's loop needs to accept the request
    accepted: Future  # None when accepted; ValueError, Overloaded, Unavailable or another exception otherwise


@dataclass
class Abort:
    request_id: str
    done: Future  # True when the request was live


@dataclass
class Call:
    fn: Callable[[], object]  # runs on the loop thread (it owns the instance), e.g. a prefix-cache flush
    done: Future  # fn's result, or its exception (Unavailable when the loop has stopped)


class InstanceLoop(ABC):
    """The loop thread. submit(), abort(), busy() and stop() are thread-safe; the rest runs on the thread.

    A role implements iterate() (one pass: take commands with take_commands(), then advance the
    scheduler), accept(cmd) (raise to refuse), cancel(request_id) -> bool, fail_all(message) and
    close(). A finished request is announced with emit()."""

    role = "instance"

    def __init__(self, on_fatal: Callable[[str], None] | None = None):
        self.on_fatal = on_fatal
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.listeners: dict[str, Listener] = {}
        self._stop = threading.Event()
        self._stop_reason = f"the {self.role} instance is shutting down"
        self._closed, self._lock = False, threading.Lock()  # once closed, no command can be left unanswered
        self._thread: threading.Thread | None = None

    # --- thread-safe -------------------------------------------------------------------------

    def put_submit(self, request_id: str, listener: Listener, payload: object) -> Future:
        return self._put(Submit(request_id, listener, payload, Future()))

    def abort(self, request_id: str) -> Future:
        return self._put(Abort(request_id, Future()))

    def call(self, fn: Callable[[], object]) -> Future:
        """Runs fn() on the loop thread between two iterations; its Future holds the result."""
        return self._put(Call(fn, Future()))

    def busy(self) -> int:
        """Requests accepted or on their way in: a draining server waits for 0."""
        return len(self.listeners) + self.commands.qsize()

    def stop(self, reason: str | None = None) -> None:
        """Ends the thread; requests still live get an error event naming `reason`."""
        if reason:
            self._stop_reason = reason
        self._stop.set()
        self.commands.put(None)  # wakes an idle thread

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name=f"{self.role}-loop", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _put(self, cmd: Submit | Abort | Call) -> Future:
        with self._lock:
            if self._closed:
                self._refuse(cmd)
            else:
                self.commands.put(cmd)
        return cmd.accepted if isinstance(cmd, Submit) else cmd.done

    def _refuse(self, cmd: Submit | Abort | Call) -> None:
        if isinstance(cmd, Submit):
            cmd.accepted.set_exception(Unavailable(f"the {self.role} instance is shutting down"))
        elif isinstance(cmd, Call):
            cmd.done.set_exception(Unavailable(f"the {self.role} instance is shutting down"))
        else:
            cmd.done.set_result(False)

    # --- the loop thread ---------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                self.iterate()
        except Exception as e:  # a rank died or the group broke (RankError), or a bug outside any one request
            message = f"{self.role} step failed: {type(e).__name__}: {e}"
            self.fail_all(message)
            if not self._stop.is_set() and self.on_fatal:  # while stopping, the ranks going away is expected
                time.sleep(0.5)  # lets the handlers flush the error to their clients
                self.on_fatal(message)
        with self._lock:
            self._closed = True
        self.fail_all(self._stop_reason)
        self.close()
        while not self.commands.empty():
            cmd = self.commands.get_nowait()
            if cmd is not None:
                self._refuse(cmd)

    def take_commands(self, wait_s: float) -> None:
        """Handles every queued command, blocking up to wait_s for the first one."""
        try:
            cmd = self.commands.get(timeout=wait_s) if wait_s > 0 else self.commands.get_nowait()
            while cmd is not None:
                self._handle(cmd)
                cmd = self.commands.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, cmd: Submit | Abort | Call) -> None:
        if isinstance(cmd, Call):
            try:
                cmd.done.set_result(cmd.fn())
            except Exception as e:
                cmd.done.set_exception(e)
            return
        if isinstance(cmd, Abort):
            was_live = self.cancel(cmd.request_id)
            self.emit(cmd.request_id, Finished("abort"))
            cmd.done.set_result(was_live)
            return
        if cmd.request_id in self.listeners:
            cmd.accepted.set_exception(ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        self.listeners[cmd.request_id] = cmd.listener  # before accept(): it may end the request at once
        try:
            self.accept(cmd)
        except Exception as e:
            self.listeners.pop(cmd.request_id, None)
            cmd.accepted.set_exception(e)
            return
        cmd.accepted.set_result(None)

    def emit(self, request_id: str, event: Event) -> None:
        """Delivers one event; a Finished or a Failed is the request's last."""
        listener = self.listeners.get(request_id)
        if isinstance(event, (Finished, Failed)):
            self.listeners.pop(request_id, None)
        if listener:
            try:
                listener(event)
            except RuntimeError:  # the handler's event loop is closed (server shutting down): nobody to tell
                pass

    def fail_listeners(self, message: str) -> None:
        """Every live request ends with a Failed naming `message`: the instance's failure, not theirs."""
        for request_id in list(self.listeners):
            self.emit(request_id, Failed(message, instance_failed=True))

    # --- what a role implements (a role missing one of these cannot be instantiated) ---------

    @abstractmethod
    def iterate(self) -> None:
        """One pass of the loop: take commands (take_commands), then advance the instance."""

    @abstractmethod
    def accept(self, cmd: Submit) -> None:
        """Admits a submitted request; raises ValueError (400), Overloaded (429) or Unavailable (503)."""

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Aborts a request; False when it is unknown (already finished)."""

    def fail_all(self, message: str) -> None:
        self.fail_listeners(message)

    def close(self) -> None:  # noqa: B027 (optional: a role with nothing to close keeps this)
        """Releases what the role holds besides the instance (after the loop ended)."""


def serve_instance(
    cfg,
    instance,
    make_loop: Callable[[], InstanceLoop],
    make_app: Callable[[InstanceLoop, Drain], object],
) -> None:
    """Starts the ranks, the loop thread, the watchdog and HTTP; returns once drained and stopped.
    cfg: a server config (host, port, shutdown_grace_s); make_app(loop, drain) -> the FastAPI app."""
    install_exit_signals()  # during startup a signal exits through the `finally` below, stopping the ranks
    stop = threading.Event()
    loop: InstanceLoop | None = None
    try:
        instance.start()
        loop = make_loop()
        loop.start()
        start_watchdog(instance, loop.role, stop)
        drain = Drain(loop.role, cfg.shutdown_grace_s, loop.busy)
        config = server_config(make_app(loop, drain), cfg.host, cfg.port, timeout_graceful_shutdown=5)
        DrainingServer(config, drain, on_exit=loop.stop).run()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not interrupt the shutdown
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop.set()
        if loop:
            loop.stop()
            loop.join(timeout=10)  # finish the current step before the ranks go away under it
        instance.shutdown()
