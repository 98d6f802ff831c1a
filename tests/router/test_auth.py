"""Authentication at the HTTP edges (docs/design.md invariant 11).

Instance APIs answer 401 without the internal token (only /health and /live are open), so nobody
but the router can run a prefill, read /info or /capacity, abort a request, or make a decode
instance send its reservation (with the pool's layout) to an endpoint of their choosing. The
router's /v1 API takes an optional API key. Weak admin tokens and a missing internal token are
startup errors; `pdserve up` hands its generated token to its children through the environment only.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import zmq

from pdserve.router.config import RouterConfig
from tests.router.helpers import running_router
from tests.servers import TEST_TOKEN, http

OPEN = ("/health", "/live")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-wrong-token-123"},
        {"Authorization": f"Basic {TEST_TOKEN}"},
        {"Authorization": TEST_TOKEN},
    ],
)
def test_instance_apis_need_the_internal_token(instances, headers):
    p_url, d_url = instances
    calls = [
        ("GET", f"{p_url}/info", None),
        ("POST", f"{p_url}/v1/prefill", {"token_ids": [5]}),
        ("GET", f"{d_url}/capacity", None),
        ("POST", f"{d_url}/v1/generate", {"token_ids": [5]}),
        ("POST", f"{d_url}/v1/abort", {"request_id": "x"}),
        ("GET", f"{d_url}/openapi.json", None),
    ]
    for method, url, body in calls:
        r = httpx.request(method, url, json=body, headers=headers, timeout=10)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (
            url,
            r.status_code,
            r.text,
        )
        assert r.json()["error"]["code"] == "invalid_api_key"
    for base in (p_url, d_url):
        for path in OPEN:
            assert httpx.get(f"{base}{path}", headers=headers, timeout=10).status_code == 200
    assert http.get(f"{d_url}/capacity").status_code == 200  # with the token


def test_an_unauthenticated_caller_cannot_make_the_decode_send_a_reservation(instances):
    _, d_url = instances
    ctx = zmq.Context()
    trap = ctx.socket(zmq.ROUTER)  # a bootstrap endpoint the caller controls
    port = trap.bind_to_random_port("tcp://127.0.0.1")
    try:
        body = {"token_ids": [5, 6, 7], "max_tokens": 2, "bootstrap": f"tcp://127.0.0.1:{port}"}
        r = httpx.post(f"{d_url}/v1/generate", json=body, timeout=10)
        assert r.status_code == 401
        assert not trap.poll(1500), "the decode instance sent something to the caller's endpoint"
    finally:
        trap.close(0)
        ctx.term()


def test_router_api_key(model_dir, instances):
    p_url, d_url = instances
    key = "client-api-key-8c1f0e3a77"
    cfg = RouterConfig(
        model=str(model_dir), prefill=(p_url,), decode=(d_url,), served_model_name="tiny", api_key=key
    )
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    with running_router(cfg) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):  # the API's map is not shown to strangers
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 404, path
        ok = httpx.post(
            f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        assert ok.status_code == 200, ok.text


def test_weak_or_missing_secrets_are_startup_errors(model_dir):
    for weak in ("change-me", "short", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"):
        with pytest.raises(ValueError, match="admin token is too weak"):
            RouterConfig(model=str(model_dir), admin_token=weak)
    for weak in ("sk-test", "abababababababababab"):  # issue 40 item 7: API keys too
        with pytest.raises(ValueError, match="--api-key is too weak"):
            RouterConfig(model=str(model_dir), prefill=("http://p",), decode=("http://d",), api_key=weak)
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_INTERNAL_TOKEN"}
    for args in (["prefill"], ["decode"], ["router"]):
        out = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", *args, "--model", str(model_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and "no internal token" in out.stderr, (args, out.stderr[-500:])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "prefill",
            "--model",
            str(model_dir),
            "--internal-token",
            "change-me",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "internal token is too weak" in out.stderr, out.stderr[-500:]
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--model", str(model_dir), "--check-config"],
        env={**env, "PDSERVE_INTERNAL_TOKEN": TEST_TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and TEST_TOKEN not in out.stdout and '"internal_token": "***"' in out.stdout, (
        out
    )
