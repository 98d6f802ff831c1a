"""`pdserve decode` as users run it: a real process with real rank processes behind HTTP.

/capacity agrees with the capacity formula; /v1/generate (plain and streamed) agrees with the
single-rank engine; a client that goes away mid-stream gets its pages freed; bad input is a 400;
killing a rank stops the instance within 10 s naming the rank, with no orphans; SIGTERM stops
everything once the shutdown grace period ends; --check-config reports the capacity formula's slots and startup errors are clear.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvcache import capacity
from pdserve.model.config import ModelConfig
from pdserve.model.shard import weight_bytes_by_dtype
from pdserve.model.weights import rank_model
from pdserve.request import SamplingParams
from tests.servers import http, pid_alive, start_server

MAX_KV_TOKENS = 4096  # room for a long request, so the disconnect test can only pass by aborting it


def pdserve_decode(model, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "decode", "--model", str(model), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def wait_all_free(url: str, timeout_s: float = 15) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cap = http.get(f"{url}/capacity").json()
        if cap["free_tokens"] == cap["total_tokens"] and cap["running"] == cap["queued"] == 0:
            return cap
        time.sleep(0.1)
    raise AssertionError(f"KV pages not freed within {timeout_s} s: {cap}")


def assert_no_orphans(rank_pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in rank_pids), "orphan rank processes remain"


@pytest.fixture()
def glm(tiny_checkpoints):
    return tiny_checkpoints[("glm_moe_dsa", "make-model")]


def check_capacity(url: str, glm) -> dict:
    cap = http.get(f"{url}/capacity").json()
    assert cap["total_tokens"] == cap["free_tokens"] == MAX_KV_TOKENS and cap["running"] == cap["queued"] == 0
    want = capacity.bytes_per_token_per_rank(ModelConfig.from_pretrained(glm), 2, "split", "auto", "float32")
    assert cap["bytes_per_token_per_rank"] == want
    assert (cap["index_mode"], cap["tp_size"], cap["dcp_size"], cap["kv_cache_dtype"]) == (
        "split",
        2,
        2,
        "auto",
    )
    assert len(cap["ranks"]) == 2 and all(r["cache_bytes"] == want * MAX_KV_TOKENS for r in cap["ranks"])
    info = http.get(f"{url}/info").json()  # the same, with each rank's weight bytes by dtype
    whole = sum(weight_bytes_by_dtype(rank_model(glm, torch.float32)).values())
    for r in info["ranks"]:
        assert set(r["weight_bytes_by_dtype"]) == {"float32"}  # a float32 checkpoint on the CPU
        assert r["weight_bytes"] == r["weight_bytes_by_dtype"]["float32"] < whole  # its TP share only
    assert info["total_tokens"] == cap["total_tokens"]
    return cap


def check_generate(url: str, glm) -> None:
    ids, n = list(range(5, 40)), 12
    want = LLMEngine.from_pretrained(glm).generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    body = {"token_ids": ids, "max_tokens": n, "ignore_eos": True}
    r = http.post(f"{url}/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == want and r.json()["finish_reason"] == "length"
    with http.stream(
        "POST", f"{url}/v1/generate", json={**body, "stream": True, "request_id": "s1"}, timeout=60
    ) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [x["token"] for x in lines[:-1]] == want
    assert lines[-1] == {"finish_reason": "length", "request_id": "s1"}


def check_disconnect_frees_pages(url: str) -> None:
    body = {"token_ids": [7] * 10, "max_tokens": MAX_KV_TOKENS - 10, "ignore_eos": True, "stream": True}
    with http.stream("POST", f"{url}/v1/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert "token" in json.loads(next(lines)) and "token" in json.loads(next(lines))
        assert http.get(f"{url}/capacity").json()["running"] == 1
    wait_all_free(url)  # about 4000 more decode steps had it not been aborted


def check_bad_input(url: str) -> None:
    bad = http.post(f"{url}/v1/generate", json={"token_ids": [1, 10**7]})
    assert bad.status_code == 400 and "token ids must be in [0, 512)" in bad.text
    bad = http.post(f"{url}/v1/generate", json={"token_ids": [1], "top_p": 0})
    assert bad.status_code == 400 and "top_p" in bad.text
    too_big = http.post(f"{url}/v1/generate", json={"token_ids": [5] * 100, "max_tokens": MAX_KV_TOKENS})
    assert too_big.status_code == 400 and f"holds {MAX_KV_TOKENS}" in too_big.text
    assert http.post(f"{url}/v1/abort", json={"request_id": "nope"}).json() == {"aborted": False}


def sigterm_mid_stream(proc: subprocess.Popen, url: str) -> None:
    """A stream still running when the shutdown grace period (1 s) ends gets an error line, not a cut
    connection (tests/router/test_drain.py: one that finishes within it runs to its end)."""
    body = {"token_ids": [7] * 10, "max_tokens": MAX_KV_TOKENS - 10, "ignore_eos": True, "stream": True}
    with http.stream("POST", f"{url}/v1/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert "token" in json.loads(next(lines))
        proc.send_signal(signal.SIGTERM)
        last = json.loads([line for line in lines if line][-1])
    assert last["error"] == "the decode instance shut down: its 1 s shutdown grace period ended", last


@pytest.mark.slow
def test_decode_server_serves_streams_frees_and_stops_on_sigterm(glm):
    proc, url = start_server(
        "decode",
        glm,
        "--tp-size",
        "2",
        "--dcp-size",
        "2",
        "--dcp-index",
        "split",
        "--shutdown-grace",
        "1",
        max_kv_tokens=MAX_KV_TOKENS,
    )
    rank_pids = []
    try:
        rank_pids = [r["pid"] for r in check_capacity(url, glm)["ranks"]]
        check_generate(url, glm)
        check_disconnect_frees_pages(url)
        check_bad_input(url)
        wait_all_free(url)
        sigterm_mid_stream(proc, url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()
    assert_no_orphans(rank_pids)


@pytest.mark.slow
def test_killing_a_rank_stops_the_instance_naming_it(glm):
    proc, url = start_server("decode", glm, "--tp-size", "2", "--dcp-size", "2", max_kv_tokens=MAX_KV_TOKENS)
    rank_pids = [r["pid"] for r in http.get(f"{url}/capacity").json()["ranks"]]
    os.kill(rank_pids[1], signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the instance did not stop within 10 s of a rank's death") from None
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr.read()
    assert_no_orphans(rank_pids)


def test_check_config_reports_the_capacity_formulas_slots(glm):
    proc = pdserve_decode(
        glm,
        "--tp-size",
        "2",
        "--dcp-size",
        "2",
        "--dcp-index",
        "split",
        "--kv-memory",
        "64MiB",
        "--check-config",
    )
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads(proc.stdout)
    want = capacity.tokens_for_budget(
        ModelConfig.from_pretrained(glm), 64 * 2**20, 2, "split", 64, "auto", "float32"
    )
    assert cfg["num_slots"] == want > 0 and cfg["kv_memory"] == 64 * 2**20 and cfg["max_kv_tokens"] is None


@pytest.mark.parametrize(
    "args,message",
    [
        (("--tp-size", "3"), "4 attention heads cannot be split over --tp-size 3"),
        (("--tp-size", "2", "--dcp-size", "3"), "--dcp-size 3 must divide --tp-size 2"),
        (("--kv-memory", "1GiB", "--max-kv-tokens", "64"), "not both"),
    ],
)
def test_bad_decode_config_is_a_clear_startup_error(glm, args, message):
    proc = pdserve_decode(glm, *args, "--check-config")
    assert proc.returncode == 2
    assert message in proc.stderr
