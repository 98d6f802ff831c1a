"""Helpers for tests that run `pdserve prefill` / `pdserve decode` as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.reference import free_port

# Every server a test starts inherits this internal token (tests/conftest.py puts it in the
# environment); `http` sends it, so tests reach the instances' authenticated APIs.
TEST_TOKEN = "pdserve-test-internal-token-7f3a9c1e5b"
AUTH = {"Authorization": f"Bearer {TEST_TOKEN}"}
# 30 s: make test runs two xdist workers on 2 cores, and a busy instance may answer slowly; a test
# that means a shorter wait says so per call
http = httpx.Client(headers=AUTH, timeout=30.0)


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def start_server(role: str, model, *args: str, max_kv_tokens: int = 2048) -> tuple[subprocess.Popen, str]:
    """Starts `pdserve ROLE` on free ports and polls /health (deadline 120 s); returns (process, url)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            role,
            "--model",
            str(model),
            "--port",
            str(port),
            "--dist-port",
            str(free_port()),
            "--max-kv-tokens",
            str(max_kv_tokens),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{role} server exited: {proc.stderr.read()}")
        try:
            if http.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{role} server not healthy within 120 s")


def wait_until(predicate, what: str, timeout_s: float = 30.0, every_s: float = 0.1):
    """predicate()'s first truthy value, polled every every_s; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every_s)
