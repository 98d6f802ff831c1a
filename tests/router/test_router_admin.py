"""`pdserve router` as a process in front of two prefill instances (A, B) and one decode instance,
driven through its admin API and `pdserve admin --router URL ...`.

The admin API needs the bearer token (401 without or with a wrong one; 404 when no token is
configured); drain, remove and add change both what `topology` shows and where requests go;
/metrics is valid Prometheus text that counts what happened; a prefill instance that dies while
the router still thinks it healthy costs a retry on the other one, not a failed request; a decode
rank killed mid-stream ends that stream with an error event (no other decode instance to move it to
within --migration-wait), the instance is marked unhealthy, with no decode left the router answers 503, and once a healthy decode instance is added requests go there.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from pdserve.model.config import ModelConfig
from pdserve.router.config import RouterConfig
from tests.router.helpers import (
    decode_idle,
    metric,
    running_router,
    start_router_cli,
    start_servers,
    stop_all,
    wait_until,
)
from tests.servers import http

TOKEN = "admin-test-token-a83f61c2d9"


@pytest.fixture(scope="module")
def topo(model_dir):
    servers = start_servers(
        model_dir,
        [
            ("prefill", "--bootstrap-timeout", "5"),
            ("prefill", "--bootstrap-timeout", "5"),
            ("decode", "--page-size", "4", "--transfer-timeout", "5"),
        ],
    )
    (_, a), (_, b), (_, d) = servers
    procs = [p for p, _ in servers]
    try:  # health checks every 60 s: only a failed request can tell the router that B died
        router, url = start_router_cli(
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--prefill",
            a,
            "--prefill",
            b,
            "--decode",
            d,
            "--admin-token",
            TOKEN,
            "--health-interval",
            "60",
            "--migration-wait",  # the dead decode's streams have nowhere to go: they end within ~1 s
            "1",
        )
        procs.append(router)
        auth = {"Authorization": f"Bearer {TOKEN}"}  # /admin/capacity polls every instance now
        wait_until(
            lambda: (
                http.get(f"{url}/admin/capacity", headers=auth, timeout=30).status_code == 200
                and http.get(f"{url}/health").status_code == 200
            ),
            "the router to be ready",
            60,
        )
        yield {
            "url": url,
            "a": a,
            "b": b,
            "d": d,
            "procs": dict(zip(("a", "b", "d"), procs)),
            "model_dir": model_dir,
        }
    finally:
        stop_all(procs)


def admin(topo, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "admin", "--router", topo["url"], "--token", token, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def served(topo) -> dict[str, int]:
    out = admin(topo, "topology", "--json")
    assert out.returncode == 0, out.stderr
    return {row["url"]: row["served"] for row in json.loads(out.stdout)["instances"]}


def complete(topo, n: int = 1) -> None:
    for _ in range(n):
        body = {"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        r = http.post(f"{topo['url']}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


@pytest.mark.slow
def test_admin_api_needs_the_token(topo, model_dir):
    url = topo["url"]
    assert http.get(f"{url}/admin/topology").status_code == 401
    r = http.get(f"{url}/admin/topology", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.post(f"{url}/admin/drain", json={"url": topo["a"]}).status_code == 401
    assert http.get(f"{url}/admin/topology", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    bad = admin(topo, "drain", topo["a"], token="wrong")
    assert bad.returncode == 1 and "401" in bad.stderr
    assert not any(
        row["draining"] for row in json.loads(admin(topo, "topology", "--json").stdout)["instances"]
    )
    with running_router(RouterConfig(model=str(model_dir))) as (
        plain,
        _,
    ):  # no token configured: no admin API
        r = http.get(f"{plain}/admin/topology", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 404 and "disabled" in r.json()["error"]["message"]


@pytest.mark.slow
def test_topology_and_capacity_tables(topo):
    table = admin(topo, "topology")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    assert set(rows) == {topo["a"], topo["b"], topo["d"]}
    assert "CP=1" in rows[topo["a"]] and "healthy" in rows[topo["a"]]
    assert "TP=1 DCP=1" in rows[topo["d"]] and "copy" in rows[topo["d"]]
    cap = admin(topo, "capacity", "--json")
    decode_row = next(r for r in json.loads(cap.stdout)["instances"] if r["role"] == "decode")
    assert decode_row["total_tokens"] >= decode_row["free_tokens"] > 0
    assert re.search(r"\d+/" + f"{decode_row['total_tokens']:,}", admin(topo, "capacity").stdout)


@pytest.mark.slow
def test_drain_remove_add_change_topology_and_routing(topo):
    a, b = topo["a"], topo["b"]
    assert admin(topo, "drain", a).returncode == 0
    assert "draining" in admin(topo, "topology").stdout
    before = served(topo)
    complete(topo, 3)
    after = served(topo)
    assert after[a] == before[a] and after[b] == before[b] + 3
    assert admin(topo, "remove", a).returncode == 0
    assert a not in served(topo)
    complete(topo, 1)
    assert served(topo)[b] == after[b] + 1
    added = admin(topo, "add", "prefill", a, "--json")
    assert added.returncode == 0 and json.loads(added.stdout)["healthy"], added.stdout
    assert admin(topo, "add", "prefill", a).returncode == 1  # already there
    complete(topo, 4)  # round robin over A and B again
    now = served(topo)
    assert now[a] == 2 and now[b] == after[b] + 3


@pytest.mark.slow
def test_metrics_are_prometheus_text(topo):
    complete(topo, 2)
    text = http.get(f"{topo['url']}/metrics").text
    completed = metric(text, "pdserve_router_requests_total", outcome="completed")
    assert completed >= 2
    for h in ("time_to_first_token", "inter_token_latency", "e2e_latency"):
        name = f"pdserve_router_{h}_seconds"
        buckets = [float(v) for v in re.findall(rf'^{name}_bucket{{le="[^"]+"}} (\S+)$', text, re.MULTILINE)]
        assert buckets == sorted(buckets) and buckets[-1] == metric(text, f"{name}_count") > 0
    assert metric(text, "pdserve_router_time_to_first_token_seconds_count") == completed
    assert metric(text, "pdserve_router_inter_token_latency_seconds_count") == 2 * completed  # 3 tokens each
    assert metric(text, "pdserve_instance_kv_free_tokens", instance=topo["d"], role="decode") > 0
    assert metric(text, "pdserve_instance_queue_depth", instance=topo["a"], role="prefill") == 0
    assert metric(text, "pdserve_instance_healthy", instance=topo["b"], role="prefill") == 1
    assert (
        metric(text, "pdserve_instance_transfers_completed", instance=topo["d"], role="decode") >= completed
    )
    per = metric(text, "pdserve_instance_transfer_bytes", instance=topo["d"], role="decode") / metric(
        text, "pdserve_instance_transfers_completed", instance=topo["d"], role="decode"
    )
    assert per == handoff_bytes(topo["model_dir"], 3)  # every request here has a 3-token prompt
    assert metric(text, "pdserve_instance_transfer_seconds", instance=topo["d"], role="decode") > 0


@pytest.mark.slow
def test_capacity_shows_cached_tokens_and_flush_returns_them(topo):
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def rows() -> dict:
        cap = http.get(f"{topo['url']}/admin/capacity", headers=auth, timeout=30).json()
        return {r["url"]: r for r in cap["instances"]}

    before = rows()
    body = {
        "model": "tiny",
        "prompt": list(range(10, 50)),
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert http.post(f"{topo['url']}/v1/completions", json=body, timeout=60).status_code == 200
    wait_until(lambda: decode_idle(topo["d"]), "the decode instance to finish")
    after = rows()
    d = after[topo["d"]]  # prompt + 2 computed output tokens, whole pages of 4
    assert d["cached_tokens"] - before[topo["d"]]["cached_tokens"] == 40
    assert d["free_tokens"] + d["cached_tokens"] + d["in_use_tokens"] == d["total_tokens"]
    grew = sum(after[u]["cached_tokens"] - before[u]["cached_tokens"] for u in (topo["a"], topo["b"]))
    assert grew == 32  # the prompt's whole 16-token pages, on the prefill instance that served it
    table = admin(topo, "capacity").stdout  # the CLI's table and its flush command
    assert "cached" in table.splitlines()[0] and f"{d['cached_tokens']:,}" in table
    out = admin(topo, "flush", topo["d"], "--json")
    assert out.returncode == 0, out.stderr
    flushed = {topo["d"]: json.loads(out.stdout)}
    for url in (topo["a"], topo["b"]):
        r = http.post(f"{topo['url']}/admin/flush", json={"url": url}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        flushed[url] = r.json()
    for url, row in flushed.items():
        assert row["flushed_tokens"] == after[url]["cached_tokens"] and row["cached_tokens"] == 0
        assert row["free_tokens"] == row["total_tokens"]
    missing = http.post(f"{topo['url']}/admin/flush", json={"url": "http://127.0.0.1:9"}, headers=auth)
    assert missing.status_code == 404


@pytest.mark.slow
def test_dead_prefill_instance_costs_a_retry_not_a_failure(topo):
    victim = topo["procs"]["b"]
    victim.terminate()
    victim.wait(30)
    failed_before = http.get(f"{topo['d']}/capacity").json()["transfers_failed"]
    complete(topo, 2)  # round robin: one of them is sent to B first
    # the decode half of the failed try was aborted by the router, not left to its transfer timeout
    wait_until(lambda: decode_idle(topo["d"]), "the decode instance to be idle")
    assert http.get(f"{topo['d']}/capacity").json()["transfers_failed"] == failed_before
    text = http.get(f"{topo['url']}/metrics").text
    assert metric(text, "pdserve_router_retries_total", role="prefill") >= 1
    assert metric(text, "pdserve_router_requests_total", outcome="failed") == 0
    rows = served_rows(topo)
    assert not rows[topo["b"]]["healthy"] and rows[topo["b"]]["error"]
    assert "unhealthy" in admin(topo, "topology").stdout


@pytest.mark.slow
def test_dead_decode_rank_mid_stream_is_an_error_event_then_503(topo, model_dir):
    client = openai.OpenAI(base_url=f"{topo['url']}/v1", api_key="unused", max_retries=0, timeout=60)
    rank_pid = http.get(f"{topo['d']}/capacity").json()["ranks"][0]["pid"]
    stream = client.completions.create(
        model="tiny",
        prompt=[7, 8, 9],
        max_tokens=2000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert next(iter(stream)).choices[0].text is not None  # tokens are flowing
    os.kill(rank_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="decode"):
        for _ in stream:
            pass
    wait_until(
        lambda: not served_rows(topo)[topo["d"]]["healthy"], "the decode instance to be marked unhealthy"
    )
    r = http.post(f"{topo['url']}/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2})
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text
    text = http.get(f"{topo['url']}/metrics").text
    assert metric(text, "pdserve_router_requests_total", outcome="failed") == 1
    assert http.get(f"{topo['url']}/health").status_code == 503
    # a healthy decode instance joins: later requests go there
    [(spare, e)] = start_servers(model_dir, [("decode", "--page-size", "4")])
    try:
        added = admin(topo, "add", "decode", e, "--json")
        assert added.returncode == 0 and json.loads(added.stdout)["healthy"], added.stdout
        complete(topo, 2)
        assert served(topo)[e] == 2 and http.get(f"{topo['url']}/health").status_code == 200
    finally:
        stop_all([spare])


def handoff_bytes(model_dir, prompt_len: int) -> int:
    """What a hand-off of a prompt into a one-rank decode instance carries: every layer's latent row and
    every indexer layer's key, in float32."""
    cfg = ModelConfig.from_pretrained(model_dir)
    return prompt_len * 4 * (cfg.num_layers * cfg.kv_entry_dim + len(cfg.indexer_layers) * cfg.index_head_dim)


def served_rows(topo) -> dict[str, dict]:
    return {r["url"]: r for r in json.loads(admin(topo, "topology", "--json").stdout)["instances"]}
