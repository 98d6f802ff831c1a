"""`pdserve prefill` as users run it: a real process with real rank processes behind HTTP.

Startup errors are clear; /health, /info and /v1/prefill work and agree with the single-rank
engine; killing a rank stops the instance within 10 s naming the rank, with no orphans; SIGTERM
stops everything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.servers import http, pid_alive, start_server


@pytest.fixture()
def glm(tiny_checkpoints):
    return tiny_checkpoints[("glm_moe_dsa", "make-model")]


@pytest.mark.slow
def test_prefill_server_serves_and_stops_on_sigterm(glm):
    proc, url = start_server("prefill", glm, "--cp-size", "2", "--chunk-size", "16")
    try:
        info = http.get(f"{url}/info").json()
        assert info["cp_size"] == 2 and info["layout"] == "interleave" and info["cache"] == "full"
        assert len(info["ranks"]) == 2 and all(r["cache_bytes"] > 0 for r in info["ranks"])
        ids = list(range(5, 60))
        r = http.post(f"{url}/v1/prefill", json={"token_ids": ids}, timeout=60)
        assert r.status_code == 200, r.text
        want = LLMEngine.from_pretrained(glm).generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[
            0
        ][0]
        assert r.json()["first_token"] == want and r.json()["prompt_tokens"] == len(ids)
        bad = http.post(f"{url}/v1/prefill", json={"token_ids": [1, 10**7]})
        assert bad.status_code == 400 and "token ids" in bad.text
        too_long = http.post(f"{url}/v1/prefill", json={"token_ids": [5] * 5000})
        assert too_long.status_code == 400 and "exceeds" in too_long.text
        rank_pids = [r["pid"] for r in info["ranks"]]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in rank_pids)


@pytest.mark.slow
def test_killing_a_rank_stops_the_instance_naming_it(glm):
    proc, url = start_server("prefill", glm, "--cp-size", "3", "--cache", "layer-split")
    rank_pids = [r["pid"] for r in http.get(f"{url}/info").json()["ranks"]]
    os.kill(rank_pids[1], signal.SIGKILL)
    start = time.monotonic()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the instance did not stop within 10 s of a rank's death") from None
    assert time.monotonic() - start < 10
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr.read()
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in rank_pids), "orphan rank processes remain"


def test_zigzag_for_a_sparse_model_is_a_clear_startup_error(glm):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "prefill",
            "--model",
            str(glm),
            "--cp-size",
            "2",
            "--cp-layout",
            "zigzag",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "zigzag is not supported for glm_moe_dsa" in proc.stderr
