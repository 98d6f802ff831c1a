"""The KV hand-off between two real servers, driven over HTTP the way the router drives it.

`pdserve prefill` (C_p = 2) and `pdserve decode` (W = C_d = 2, split index) run as processes, with
`--transfer nixl` (the TCP data path runs through the same HTTP code, tests/router covers it). For
one room the decode instance is asked to generate with the prefill's bootstrap endpoint, and the
prefill instance to prefill with `handoff`, in either order and for several rooms at once: the
tokens equal the single-rank engine's greedy tokens and the prefill's first token is the first one.
Failures end the request with the reason and release both sides: a prefill whose decode
reservation never comes (bootstrap timeout), a decode whose prefill never comes (transfer timeout),
and a prefill instance killed while it works on the room (the sender dies: its heartbeats stop
and the decode request fails after the heartbeat timeout; the decode instance stays healthy and
idle).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.servers import http, start_server

TOKENS = 10


@pytest.fixture(scope="module")
def stack(tiny_checkpoints):
    glm = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    prefill, p_url = start_server(
        "prefill", glm, "--cp-size", "2", "--bootstrap-timeout", "3", "--transfer", "nixl"
    )
    decode, d_url = start_server(
        "decode",
        glm,
        "--tp-size",
        "2",
        "--dcp-size",
        "2",
        "--dcp-index",
        "split",
        "--page-size",
        "4",
        "--transfer-timeout",
        "4",
        "--transfer",
        "nixl",
        "--heartbeat-timeout",
        "2",
        "--transfer-quarantine",
        "2",
    )
    try:
        yield glm, p_url, d_url, http.get(f"{p_url}/info").json()["bootstrap"]
    finally:
        for proc in (prefill, decode):
            proc.terminate()
            proc.wait(30)


def generate(d_url: str, bootstrap: str, room: str, ids: list[int], stream: bool = False) -> dict:
    body = {
        "token_ids": ids,
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "request_id": room,
        "bootstrap": bootstrap,
    }
    if not stream:
        r = http.post(f"{d_url}/v1/generate", json=body, timeout=60)
        return {"status": r.status_code, **r.json()}
    with http.stream("POST", f"{d_url}/v1/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    return {"status": r.status_code, "token_ids": [x["token"] for x in lines if "token" in x], **lines[-1]}


def prefill(p_url: str, room: str, ids: list[int], delay_s: float = 0.0) -> httpx.Response:
    # not a synchronization: delayed prefills reach the instance after their decode request
    time.sleep(delay_s)
    return http.post(
        f"{p_url}/v1/prefill", json={"token_ids": ids, "request_id": room, "handoff": True}, timeout=60
    )


def assert_idle(p_url: str, d_url: str) -> None:
    """Both instances idle: every decode page free or in the prefix cache, unreferenced."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cap, info = http.get(f"{d_url}/capacity").json(), http.get(f"{p_url}/info").json()
        if (
            cap["free_tokens"] + cap["cached_tokens"] == cap["total_tokens"]
            and cap["transfers_pending"] == 0
            and cap["queued"] == 0
            and info["queue_depth"] == 0
        ):
            break
        time.sleep(0.1)
    assert cap["free_tokens"] + cap["cached_tokens"] == cap["total_tokens"], cap
    assert cap["transfers_pending"] == 0 and cap["in_use_tokens"] == 0, cap
    assert info["queue_depth"] == 0, info
    assert http.get(f"{p_url}/health").status_code == http.get(f"{d_url}/health").status_code == 200


@pytest.mark.slow
def test_handoff_over_http_equals_single_rank(stack):
    glm, p_url, d_url, bootstrap = stack
    engine = LLMEngine.from_pretrained(glm)
    prompts = {f"room-{n}": [(7 * i + n) % 500 + 4 for i in range(n)] for n in (1, 5, 64, 130)}
    want = {
        room: engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
        for room, ids in prompts.items()
    }
    with ThreadPoolExecutor(
        8
    ) as pool:  # all rooms at once; the prefill comes first for some, last for others
        decoded = {
            room: pool.submit(generate, d_url, bootstrap, room, ids, stream=i % 2 == 1)
            for i, (room, ids) in enumerate(prompts.items())
        }
        prefilled = {
            room: pool.submit(prefill, p_url, room, ids, 0.3 * (i % 2))
            for i, (room, ids) in enumerate(prompts.items())
        }
        for room in prompts:
            got, p = decoded[room].result(), prefilled[room].result()
            assert p.status_code == 200, p.text
            assert got["status"] == 200 and got["finish_reason"] == "length", got
            assert got["token_ids"] == want[room], room
            assert p.json()["first_token"] == want[room][0]
    assert http.get(f"{d_url}/capacity").json()["transfers_completed"] >= len(prompts)
    assert_idle(p_url, d_url)


@pytest.mark.slow
def test_failed_handoffs_release_both_sides(stack):
    glm, p_url, d_url, bootstrap = stack
    failed_before = http.get(f"{d_url}/capacity").json()["transfers_failed"]
    # the three failures are independent rooms, waited out at once (each timeout on its own clock)
    with ThreadPoolExecutor(3) as pool:
        start = time.monotonic()
        # no decode instance ever reserves the room: the prefill gives up after --bootstrap-timeout
        lonely_prefill = pool.submit(lambda: (prefill(p_url, "lonely-prefill", [5, 6, 7]), time.monotonic()))
        # the prefill never gets the request: the decode request fails after --transfer-timeout
        lonely_decode = pool.submit(generate, d_url, bootstrap, "lonely-decode", [5, 6, 7], True)
        # an unreachable bootstrap endpoint sends no heartbeat: failed after --heartbeat-timeout, not a hang
        dead = pool.submit(generate, d_url, "tcp://127.0.0.1:9", "dead-peer", [5, 6], False)
        r, end = lonely_prefill.result()
        got, dead = lonely_decode.result(), dead.result()
    assert r.status_code == 502 and "bootstrap timeout" in r.text, r.text
    assert end - start < 10
    assert "transfer timeout" in got["error"] and "waiting for the prefill's outcome" in got["error"], got
    assert dead["status"] == 500 and "stopped answering (no heartbeat" in dead["error"]["message"], dead
    # each failed decode room counts once: the lonely one and the dead peer's
    failed = http.get(f"{d_url}/capacity").json()["transfers_failed"]
    assert failed == failed_before + 2, (failed_before, failed)
    assert_idle(p_url, d_url)
    # and both still serve
    ok = ThreadPoolExecutor(2)
    d, p = (
        ok.submit(generate, d_url, bootstrap, "after", [9, 8, 7]),
        ok.submit(prefill, p_url, "after", [9, 8, 7]),
    )
    assert p.result().status_code == 200 and d.result()["finish_reason"] == "length"
    assert_idle(p_url, d_url)


@pytest.mark.slow
def test_handoff_requests_are_checked(stack):
    _, p_url, d_url, _ = stack
    r = http.post(f"{p_url}/v1/prefill", json={"token_ids": [1, 2], "handoff": True})
    assert r.status_code == 400 and "request_id" in r.text
    r = http.post(f"{d_url}/v1/generate", json={"token_ids": [1, 2], "bootstrap": "not-an-endpoint"})
    assert r.status_code == 400 and "bootstrap" in r.text


@pytest.mark.slow
def test_sender_killed_mid_handoff_fails_only_that_request(stack):
    glm, p_url, d_url, _ = stack
    victim, v_url = start_server("prefill", glm, "--cp-size", "2", "--transfer", "nixl", "--chunk-size", "64")
    try:
        info = http.get(f"{v_url}/info").json()
        ids = [(5 * i) % 500 + 4 for i in range(1500)]  # 24 chunks: the rank dies while the room is in flight
        pool = ThreadPoolExecutor(2)
        got = pool.submit(generate, d_url, info["bootstrap"], "doomed", ids, True)
        sent = pool.submit(prefill, v_url, "doomed", ids)
        deadline = time.monotonic() + 20
        while (
            http.get(f"{d_url}/capacity").json()["free_tokens"]
            == http.get(f"{d_url}/capacity").json()["total_tokens"]
        ):
            assert time.monotonic() < deadline, "the decode instance never reserved the room"
            time.sleep(0.02)
        while not http.get(f"{v_url}/info").json()["in_use_tokens"]:  # the prefill holds the room's pages
            assert time.monotonic() < deadline, "the prefill instance never took the room"
            time.sleep(0.02)
        victim.kill()  # the whole prefill instance dies (its ranks follow it: PDEATHSIG) without a word
        start = time.monotonic()
        result = got.result(timeout=30)
        # its heartbeats stop, and the decode notices after --heartbeat-timeout (2 s) instead of
        # waiting out its transfer timeout
        assert "stopped answering (no heartbeat" in result.get("error", ""), result
        assert time.monotonic() - start < 8
        with pytest.raises(httpx.HTTPError):  # the prefill request dies with its server
            sent.result(timeout=30)
    finally:
        victim.kill()
        victim.wait(30)
    assert_idle(p_url, d_url)  # the decode side released everything and still serves with the good prefill
    d = ThreadPoolExecutor(2)
    ok, p = (
        d.submit(generate, d_url, stack[3], "after-kill", [3, 4, 5]),
        d.submit(prefill, p_url, "after-kill", [3, 4, 5]),
    )
    assert p.result().status_code == 200 and ok.result()["finish_reason"] == "length"
