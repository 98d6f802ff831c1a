"""The router against instances that misbehave: nothing it receives may leave a request unanswered.

Stand-in instances (small FastAPI apps on real sockets, beside the real ones the other tests use)
answer health and load polls normally, then stream garbage, stall, or break off. Every request
ends with a clean OpenAI error within the request's deadline (--request-timeout), never a hang or
a dropped connection, and the router stays healthy.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from pdserve.serving.http_edge import AnswerChallenge
from pdserve.serving.http_server import server_config
from tests.reference import free_port
from tests.router.helpers import router_config, running_router
from tests.servers import TEST_TOKEN

CASES = {  # what the decode stand-in streams (chosen by the prompt's second id) before it stalls
    "not json": ["this is not json"],
    "a list": ["[1, 2, 3]"],
    "a string token": ['{"token": "five"}'],
    "an unknown event": ['{"hello": 1}'],
    "garbage after a token": ['{"token": 7}', "\x00\x01garbage"],
    "silence": [],
}
NAMES = sorted(CASES)


def _fake_instance(stall_s: float) -> FastAPI:
    """Answers health and load polls like a prefill and a decode instance (proving it holds the
    internal token, as a real one does); its data answers misbehave."""
    app = FastAPI()
    app.add_middleware(AnswerChallenge, token=TEST_TOKEN)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/info")
    def info():
        return {"bootstrap": "tcp://127.0.0.1:9", "total_tokens": 4096, "queue_depth": 0}

    @app.get("/capacity")
    def capacity():
        return {"total_tokens": 4096, "free_tokens": 4096, "queued": 0}

    @app.post("/v1/prefill")
    async def prefill():
        await asyncio.sleep(stall_s)
        return {"first_token": 5}

    @app.post("/v1/generate")
    async def generate(body: dict):
        async def lines():
            for line in CASES[NAMES[body["token_ids"][1]]]:
                yield line + "\n"
            await asyncio.sleep(stall_s)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/abort")
    def abort():
        return {"aborted": True}

    return app


@contextmanager
def serving(app: FastAPI):
    port = free_port()
    server = uvicorn.Server(
        server_config(app, "127.0.0.1", port, log_level="error", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def router(model_dir):
    with (
        serving(_fake_instance(stall_s=30)) as fake_decode,
        serving(_fake_instance(stall_s=30)) as fake_prefill,
    ):
        cfg = router_config(
            model_dir,
            fake_prefill,
            fake_decode,
            health_interval_s=60,
            max_attempts=1,
            request_timeout_s=2.0,
        )
        with running_router(cfg) as (url, _):
            yield url


@pytest.mark.parametrize("case", NAMES)
@pytest.mark.parametrize("stream", [False, True])
def test_garbage_and_silence_end_in_a_clean_error_within_the_deadline(router, case, stream):
    start = time.monotonic()
    body = {"model": "tiny", "prompt": [5, NAMES.index(case)], "max_tokens": 4, "stream": stream}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=20) as r:
        text = r.read().decode()
    elapsed = time.monotonic() - start
    assert elapsed < 6, f"{case}: answered after {elapsed:.1f} s"
    if r.status_code == 200:  # the stream had begun (a token came): an SSE error event ends it
        assert stream and '"error"' in text and text.rstrip().endswith("}"), text
    else:
        assert r.status_code in (502, 504) and r.json()["error"]["message"], text
    assert httpx.get(f"{router}/live", timeout=5).status_code == 200
