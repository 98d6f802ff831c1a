"""`pdserve up --restart on-failure`: what the launcher does once the stack is ready.

A dead instance is reported in one line (its name, exit status and log) and started again on the
same HTTP port after a backoff (1 s, doubling up to --restart-backoff-max, 30 s by default; back to 1 s once it had stayed healthy
for a minute), so the router's configured URL stays valid: the router's health loop marks it
unusable while it is down (a refused connection) and picks it up again once /health answers 200.
The restart's output is appended to the same log, after a marker line, so the crash's log survives.
The router dying stops the stack (RuntimeError), as does any instance dying with `--restart never`.
Imports no torch; `stack` is launch.Stack, its children launch.Child.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

import httpx

from ..choices import Restart, values

RESTART_POLICIES = values(Restart)


@dataclass
class Backoff:
    initial_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = (
        60.0  # healthy this long since its last (re)start: the next failure waits initial_s again
    )
    next_s: float = 1.0

    def delay(self, healthy_for_s: float) -> float:
        """The wait before the next restart of a child that was healthy for `healthy_for_s` seconds."""
        if healthy_for_s >= self.stable_s:
            self.next_s = self.initial_s
        wait, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        return wait


@dataclass
class _Watch:
    """The launcher's bookkeeping of one instance child."""

    backoff: Backoff = field(default_factory=Backoff)
    healthy_at: float | None = None  # when it last became healthy; None while (re)starting
    restart_at: float | None = None  # set once its exit was seen: when it is started again
    restarts: int = 0


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class Supervisor:
    def __init__(self, stack, router, instances: list, restart: str, echo=print, backoff_max_s: float = 30.0):
        if restart not in RESTART_POLICIES:
            raise ValueError(f"--restart must be one of {', '.join(RESTART_POLICIES)}, got {restart!r}")
        self.stack, self.router, self.restart, self.echo = stack, router, restart, echo
        now = time.monotonic()  # every instance was healthy when the stack became ready
        self.watches = {
            child.name: (child, _Watch(Backoff(max_s=backoff_max_s), healthy_at=now)) for child in instances
        }
        self.http = httpx.Client(timeout=1)  # one client for the health polls after a restart

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()

    def tick(self) -> None:
        """One look at every child; raises RuntimeError when the stack must stop."""
        code = self.router.proc.poll()
        if code is not None:
            raise RuntimeError(
                f"the router exited with {describe_exit(code)} (log {self.router.log}); stopping the stack"
            )
        now = time.monotonic()
        for child, watch in self.watches.values():
            if self.restart == "never":
                self.stack.check_alive(child)
            else:
                self._watch(child, watch, now)

    def _watch(self, child, watch: _Watch, now: float) -> None:
        code = child.proc.poll()
        if code is None:
            if watch.healthy_at is None and _healthy(self.http, child.url):
                watch.healthy_at = now
                self.echo(f"{child.name}: healthy again after restart {watch.restarts} ({child.url})")
        elif watch.restart_at is None:
            healthy_for = now - watch.healthy_at if watch.healthy_at is not None else 0.0
            wait = watch.backoff.delay(healthy_for)
            watch.restart_at, watch.healthy_at = now + wait, None
            self.echo(
                f"{child.name} exited with {describe_exit(code)} (log {child.log}); "
                f"restarting it on {child.url} in {wait:g} s"
            )
        elif now >= watch.restart_at:
            watch.restarts += 1
            watch.restart_at = None
            self.stack.respawn(
                child, f"restart {watch.restarts} of {child.name} after it exited with {describe_exit(code)}"
            )
            self.echo(
                f"{child.name}: restarted (pid {child.proc.pid}, restart {watch.restarts}, log {child.log})"
            )


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False
