"""Graceful shutdown (serving/drain.py) on real instances: SIGTERM drains instead of cutting.

Decode: a stream running at SIGTERM finishes with its finish event; while it runs, a new request
gets 503 and /health answers 503 "draining"; the router's pool then stops choosing the instance
(new requests go to the other one); the process exits 0 well within its grace period.
Prefill: a hand-off request waiting for its reservation holds the drain; a second SIGTERM cuts the
grace period short and the request fails with an error saying so (not a cut connection); the process
exits 0. (tests/decode_server/test_decode_server.py: a stream that outlives the grace period.)
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from pdserve.router.pool import NoInstance, Pool
from tests.router.helpers import start_servers, stop_all, wait_until
from tests.servers import AUTH, http, start_server

MAX_TOKENS = 400  # long enough to still be streaming while the draining checks run (~10 ms a token)


def poll_pool(pool: Pool) -> None:
    async def run():
        async with httpx.AsyncClient(headers=AUTH) as client:
            await pool.poll_all(client)

    asyncio.run(run())


def stream_in_thread(url: str, body: dict) -> tuple[list[dict], threading.Thread]:
    """Reads an NDJSON /v1/generate stream into a list from a thread; returns (lines, thread)."""
    lines: list[dict] = []

    def read():
        with http.stream("POST", f"{url}/v1/generate", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            lines.extend(json.loads(line) for line in r.iter_lines() if line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return lines, thread


def message(resp: httpx.Response) -> str:
    """An instance's error message: {"detail": ...} or OpenAI-style {"error": {"message": ...}}."""
    body = resp.json()
    err = body.get("detail") or body.get("error")
    return err.get("message", "") if isinstance(err, dict) else str(err)


def check_draining(url: str, path: str, body: dict) -> None:
    health = http.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    refused = http.post(f"{url}{path}", json=body, timeout=10)
    assert refused.status_code == 503 and "draining" in message(refused), refused.text


@pytest.mark.slow
def test_sigterm_drains_a_decode_instance_and_the_pool_avoids_it(model_dir):
    (d1, url1), (d2, url2) = start_servers(model_dir, [("decode", "--shutdown-grace", "60"), ("decode",)])
    try:
        pool = Pool((), (url1, url2), "round_robin")
        poll_pool(pool)
        assert {pool.pick("decode", 10).url for _ in range(4)} == {url1, url2}
        body = {"token_ids": [5, 6, 7, 8], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        lines, reader = stream_in_thread(url1, body)
        wait_until(lambda: lines or http.get(f"{url1}/capacity").json()["running"], "the stream to start")
        d1.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: http.get(f"{url1}/health").status_code == 503, "/health to say draining")
        check_draining(url1, "/v1/generate", {"token_ids": [5], "max_tokens": 2})
        poll_pool(pool)
        assert not pool.get(url1).usable and "draining" in pool.get(url1).error
        assert {pool.pick("decode", 10).url for _ in range(4)} == {url2}
        assert reader.is_alive(), "the stream ended before the draining checks: nothing was drained"
        reader.join(120)
        assert lines[-1].get("finish_reason") == "length", lines[-1]
        assert sum("token" in m for m in lines) == MAX_TOKENS
        assert d1.wait(60) == 0, d1.stderr.read()
        assert time.monotonic() - sent < 60
        assert "drained" in d1.stderr.read()
        poll_pool(pool)
        assert pool.get(url2).usable and not pool.get(url1).usable
        with pytest.raises(NoInstance):
            Pool((), (url1,), "round_robin").pick("decode", 10)
    finally:
        stop_all([d1, d2])


@pytest.mark.slow
def test_a_second_sigterm_cuts_a_prefill_drain_short_with_an_error(model_dir):
    proc, url = start_server("prefill", model_dir, "--shutdown-grace", "60", "--bootstrap-timeout", "120")
    try:
        answer: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: answer.append(
                http.post(
                    f"{url}/v1/prefill",
                    json={"token_ids": [5, 6, 7], "request_id": "room-1", "handoff": True},
                    timeout=120,
                )
            )
        )
        waiting.start()  # no decode instance reserves room-1: it waits for its reservation
        wait_until(lambda: http.get(f"{url}/info").json()["queue_depth"] == 1, "the hand-off to be queued")
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_until(lambda: http.get(f"{url}/health").status_code == 503, "/health to say draining")
        check_draining(url, "/v1/prefill", {"token_ids": [5]})
        time.sleep(0.5)  # not for readiness: the waiting request must still be held after a while
        assert waiting.is_alive() and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        waiting.join(60)
        detail = message(answer[0])
        assert (
            answer[0].status_code == 502 and "stopped before its 1 running request(s) finished" in detail
        ), detail
        assert proc.wait(60) == 0, proc.stderr.read()
        assert time.monotonic() - sent < 60
    finally:
        stop_all([proc])
