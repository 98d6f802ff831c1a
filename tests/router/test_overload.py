"""Bounded admission (issue: overload is answered, never queued without bound).

The router runs at most --max-in-flight requests on an instance and lets at most --max-queue more
wait for room; beyond that it answers 429 with Retry-After and an OpenAI error body, counted in
/metrics. A decode instance refuses requests beyond its --max-queue the same way, and the router
passes that on once every instance it tried was full. Admitted requests finish exactly.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.router.helpers import (
    decode_idle,
    metric,
    router_config,
    running_router,
    start_servers,
    stop_all,
    wait_until,
)
from tests.servers import http

TOKENS = 24


def _complete(url: str, ids: list[int]) -> httpx.Response:
    return http.post(
        f"{url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": ids,
            "max_tokens": TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=120,
    )


@pytest.mark.slow
def test_router_admits_a_bounded_number_and_429s_the_rest(model_dir, instances):
    p_url, d_url = instances
    cfg = router_config(
        model_dir,
        p_url,
        d_url,
        max_in_flight=1,
        max_queue=2,
    )
    prompts = [[(7 * i + n) % 400 + 5 for i in range(20 + n)] for n in range(8)]
    engine = LLMEngine.from_pretrained(model_dir)
    with running_router(cfg) as (url, _):
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda ids: _complete(url, ids), prompts))
        metrics = http.get(f"{url}/metrics").text
    ok = [(ids, r) for ids, r in zip(prompts, answers) if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(refused) == len(prompts), [r.status_code for r in answers]
    assert 1 <= len(ok) <= 3 + 1 and len(refused) >= len(prompts) - 4, [r.status_code for r in answers]
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_exceeded", r.text
    for ids, r in ok:
        want = engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
        assert r.json()["choices"][0]["token_ids"] == want
    assert metric(metrics, "pdserve_router_rejected_total", reason="router_queue_full") == len(refused)
    wait_until(lambda: decode_idle(d_url), "the decode instance to be idle")


@pytest.mark.slow
def test_a_full_decode_instance_answers_429_and_the_router_passes_it_on(model_dir, instances):
    p_url, _ = instances
    ((decode, d_url),) = start_servers(model_dir, [("decode", "--max-batch", "1", "--max-queue", "1")])
    try:
        body = {"token_ids": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with http.stream("POST", f"{d_url}/v1/generate", json=body, timeout=120) as running:
            lines = running.iter_lines()
            assert '"token"' in next(lines)  # the first request runs (max-batch 1) ...
            with http.stream("POST", f"{d_url}/v1/generate", json=body, timeout=120) as queued:
                wait_until(lambda: http.get(f"{d_url}/capacity").json()["queued"] == 1, "one queued request")
                r = http.post(f"{d_url}/v1/generate", json={**body, "stream": False}, timeout=30)
                assert r.status_code == 429 and r.headers["retry-after"] == "1", (
                    r.text
                )  # ... the third is refused
                assert "queue is full" in r.json()["error"]["message"]
                cfg = router_config(
                    model_dir,
                    p_url,
                    d_url,
                    max_attempts=2,
                    retry_backoff_s=0.05,
                )
                with running_router(cfg) as (url, _):
                    via = _complete(url, [5, 6])
                    assert via.status_code == 429 and via.headers["retry-after"] == "1", via.text
                queued.close()
            running.close()
        wait_until(lambda: decode_idle(d_url), "the decode instance to be idle")
        assert http.get(f"{d_url}/health").status_code == 200
    finally:
        stop_all([decode])
