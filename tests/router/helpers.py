"""Helpers of the router tests: a router served in this process (uvicorn in a thread), polling."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from tests.reference import free_port


@contextmanager
def running_router(cfg: RouterConfig):
    """Serves create_app(cfg) on a free port until the block ends; yields (base URL, the app)."""
    port = free_port()
    app = create_app(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "router did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def decode_idle(d_url: str) -> bool:
    cap = httpx.get(f"{d_url}/capacity").json()
    return (cap["free_tokens"] == cap["total_tokens"] and cap["running"] == 0 and cap["queued"] == 0
            and cap["transfers_pending"] == 0)
