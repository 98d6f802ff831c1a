"""Graceful shutdown of an instance (prefill or decode), shared by both servers.

The first SIGTERM (or SIGINT) starts draining: the HTTP API refuses new work with 503, /health
answers 503 {"status": "draining"} so the router (and a Kubernetes readiness probe) stops choosing
the instance, and the requests already accepted run on. Once none is left, or `grace_s` seconds
have passed, or a second signal cuts the wait short, the server's `on_exit(reason)` ends whatever
still runs with a clear error naming `reason`, and uvicorn stops; the server then exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

import uvicorn

POLL_S = 0.05


class Drain:
    """busy() -> how many accepted requests are still running (thread-safe, cheap)."""

    def __init__(self, role: str, grace_s: float, busy: Callable[[], int]):
        if grace_s < 0:
            raise ValueError(f"--shutdown-grace must be >= 0, got {grace_s}")
        self.role, self.grace_s, self.busy = role, grace_s, busy
        self._started, self._cut = threading.Event(), threading.Event()
        self.deadline = float("inf")

    @property
    def draining(self) -> bool:
        return self._started.is_set()

    def refusal(self) -> str:
        """The 503 detail for a request that arrives while draining."""
        return f"the {self.role} instance is shutting down (draining): send new requests to another instance"

    def begin(self) -> bool:
        """True on the first call (draining starts); any later call cuts the grace period short."""
        if self._started.is_set():
            self._cut.set()
            return False
        self.deadline = time.monotonic() + self.grace_s
        self._started.set()
        return True

    def wait(self) -> str | None:
        """Blocks until nothing runs (None), or the grace period ended or was cut short (the reason)."""
        while (running := self.busy()) > 0:
            if self._cut.is_set():
                return (
                    f"the {self.role} instance was stopped before its {running} running request(s) finished"
                )
            if time.monotonic() >= self.deadline:
                return (
                    f"the {self.role} instance shut down: its {self.grace_s:g} s shutdown grace period ended"
                )
            self._cut.wait(POLL_S)
        return None


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on the first signal instead of stopping at once. uvicorn itself waits for
    open responses before it stops, so `on_exit(reason)` must end the remaining requests first
    (reason None: none is left): then every stream gets its final message instead of a cut."""

    def __init__(self, config: uvicorn.Config, drain: Drain, on_exit: Callable[[str | None], None]):
        super().__init__(config)
        self.drain, self.on_exit = drain, on_exit

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # already stopping: uvicorn's own handling (a second Ctrl-C forces it)
            super().handle_exit(sig, frame)
        elif self.drain.begin():
            print(
                f"{signal.Signals(sig).name}: draining the {self.drain.role} instance: no new requests, "
                f"{self.drain.busy()} running, grace {self.drain.grace_s:g} s",
                file=sys.stderr,
                flush=True,
            )
            threading.Thread(target=self._drain_then_exit, name="drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        reason = self.drain.wait()
        print(
            f"drained; stopping the {self.drain.role} instance" if reason is None else f"{reason}; stopping",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.on_exit(reason)
        finally:
            self.should_exit = True


def exit_on_signal(signum, frame) -> None:
    """SIGTERM / SIGINT outside uvicorn (startup, or re-raised by uvicorn after it stopped): a clean
    exit through the server's `finally`, which stops the ranks (the default handler would not)."""
    raise SystemExit(0)


def install_exit_signals() -> None:
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, exit_on_signal)
