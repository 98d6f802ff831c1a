"""Helpers of the router tests: instances started together, a router in this process (uvicorn in a
thread) or as `pdserve router`, polling with a deadline."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx

from pdserve.router.app import make_server
from pdserve.router.config import RouterConfig
from tests.reference import free_port
from tests.servers import TEST_TOKEN, http, start_server, wait_until  # noqa: F401 (wait_until: re-exported)


def router_config(model_dir, prefill: str, decode: str, **overrides) -> RouterConfig:
    """The tests' router in front of one prefill and one decode instance: model name "tiny", a fast
    health interval; `overrides` are other RouterConfig fields."""
    fields = {"served_model_name": "tiny", "health_interval_s": 0.5, **overrides}
    return RouterConfig(model=str(model_dir), prefill=(prefill,), decode=(decode,), **fields)


@contextmanager
def running_router(cfg: RouterConfig):
    """Serves the router (app.make_server, as `pdserve router` does) on a free port until the block
    ends; yields (base URL, the app). The router talks to the instances with the tests' internal
    token unless cfg names another."""
    cfg = dataclasses.replace(cfg, internal_token=cfg.internal_token or TEST_TOKEN)
    port = free_port()
    server = make_server(dataclasses.replace(cfg, host="127.0.0.1", port=port))
    app = server.config.app
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


def decode_idle(d_url: str) -> bool:
    cap = http.get(f"{d_url}/capacity").json()
    return (
        cap["free_tokens"] + (cap.get("cached_tokens") or 0) == cap["total_tokens"]
        and cap["running"] == 0
        and cap["queued"] == 0
        and cap["transfers_pending"] == 0
    )


def start_servers(model_dir, specs: list[tuple[str, ...]]) -> list[tuple]:
    """start_server(role, model_dir, *args) for every (role, *args) at once; [(process, url)] in order."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_server, spec[0], model_dir, *spec[1:]) for spec in specs]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < len(specs):
        stop_all([p for p, _ in started])
        raise next(f.exception() for f in futures if f.exception() is not None)
    return started


def stop_all(procs) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def start_router_cli(*args: str) -> tuple[subprocess.Popen, str]:
    """`pdserve router ARGS` on a free port; polls /live (deadline 60 s); returns (process, url)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def live() -> bool:
        assert proc.poll() is None, f"router exited: {proc.stderr.read()}"
        try:
            return http.get(f"{url}/live", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(live, "the router to be live", 60)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a /metrics page, read with prometheus-client's own parser (which
    also refuses text that is not the exposition format)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    raise AssertionError(f"{name} {labels} not in metrics")
