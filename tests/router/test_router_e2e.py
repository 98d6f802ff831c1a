"""The router end to end with the official `openai` client, in front of a real prefill instance
(C_p = 2) and a real decode instance (W = C_d = 2, split index), KV handed off over TCP.

Greedy token ids through the whole stack equal the single-rank engine's for prompts of 1, 5, 64
and 300 tokens, streaming or not; chat uses the checkpoint's template; stop strings cut the text
and free the decode instance; bad input gets a 4xx with OpenAI's error body and the router keeps
serving; a client that leaves mid-stream frees the decode instance at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams
from pdserve.router import app as router_app
from pdserve.router.config import RouterConfig
from tests.router.helpers import decode_idle, metric, running_router, wait_until
from tests.servers import http

TOKENS = 8
ADMIN = "e2e-admin-token-5d1c8f2a9b7e"


@pytest.fixture(scope="module")
def stack(model_dir, instances):
    p_url, d_url = instances
    cfg = RouterConfig(
        model=str(model_dir),
        prefill=(p_url,),
        decode=(d_url,),
        served_model_name="tiny",
        admin_token=ADMIN,
        health_interval_s=0.5,
    )
    with running_router(cfg) as (url, app):
        yield {
            "url": url,
            "app": app,
            "p_url": p_url,
            "d_url": d_url,
            "model": model_dir,
            "client": openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60),
        }


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_pretrained(model_dir)


def greedy(engine, ids: list[int], n: int = TOKENS) -> list[int]:
    return engine.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]


def complete(client, prompt, stream: bool, **kw) -> tuple[str, list[int], str]:
    """(text, token ids, finish reason) of one completion, streamed or not."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    if not stream:
        r = client.completions.create(model="tiny", prompt=prompt, temperature=0, extra_body=extra, **kw)
        c = r.choices[0]
        assert r.usage.completion_tokens == len(c.model_extra["token_ids"])
        return c.text, c.model_extra["token_ids"], c.finish_reason
    text, ids, reason = "", [], None
    for chunk in client.completions.create(
        model="tiny", prompt=prompt, temperature=0, extra_body=extra, stream=True, **kw
    ):
        c = chunk.choices[0]
        text += c.text
        ids += c.model_extra.get("token_ids") or []
        reason = c.finish_reason or reason
    return text, ids, reason


@pytest.mark.slow
def test_completion_token_ids_equal_single_rank_engine(stack, engine):
    tok = Tokenizer.from_pretrained(stack["model"])
    prompts = [[(11 * i + n) % 500 + 4 for i in range(n)] for n in (1, 5, 64, 300)]
    want = [greedy(engine, ids) for ids in prompts]
    with ThreadPoolExecutor(4) as pool:  # all at once: the router runs them concurrently
        got = list(
            pool.map(
                lambda a: complete(stack["client"], a[1], stream=a[0] % 2 == 1, max_tokens=TOKENS),
                enumerate(prompts),
            )
        )
    for (text, ids, reason), w in zip(got, want):
        assert ids == w
        assert reason == "length"
        assert text == tok.decode(w)
    wait_until(lambda: decode_idle(stack["d_url"]), "the decode instance to be idle")


@pytest.mark.slow
def test_text_prompt_and_chat_streamed_or_not_agree_with_engine(stack, engine):
    tok, client = Tokenizer.from_pretrained(stack["model"]), stack["client"]
    ids = tok.encode("hello router")
    want = greedy(engine, ids)
    assert complete(client, "hello router", stream=False, max_tokens=TOKENS)[1] == want
    assert complete(client, "hello router", stream=True, max_tokens=TOKENS)[1] == want
    messages = [{"role": "user", "content": "hi there"}]
    chat_want = greedy(engine, tok.encode(tok.apply_chat_template(messages)))
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert r.choices[0].model_extra["token_ids"] == chat_want
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == tok.decode(chat_want)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(chat_want)
    assert chunks[-1].usage.completion_tokens == TOKENS and chunks[-1].usage.prompt_tokens > 0


@pytest.mark.slow
def test_stop_string_cuts_the_text_and_frees_the_decode(stack, engine):
    tok = Tokenizer.from_pretrained(stack["model"])
    ids = [5, 6, 7, 8]
    full = tok.decode(greedy(engine, ids, 24))
    cut = next(
        k for k in range(2, len(full) - 2) if full[k : k + 2].strip() and full.find(full[k : k + 2]) == k
    )
    stop = full[cut : cut + 2]
    for stream in (False, True):
        text, got_ids, reason = complete(stack["client"], ids, stream=stream, max_tokens=24, stop=[stop])
        assert reason == "stop" and text == full[:cut], (stream, text, full, stop)
        assert len(got_ids) < 24
    wait_until(lambda: decode_idle(stack["d_url"]), "the stopped requests' pages to be freed")


@pytest.mark.slow
def test_client_leaving_mid_stream_aborts_the_request(stack, monkeypatch):
    body = {
        "model": "tiny",
        "prompt": [9, 10, 11],
        "max_tokens": 1000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", f"{stack['url']}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # generation has started

    def aborted() -> float:
        text = http.get(f"{stack['url']}/metrics").text
        try:
            return metric(text, "pdserve_router_requests_total", outcome="aborted")
        except AssertionError:  # no request has ended "aborted" yet: the series is not there
            return 0

    # the router counts the outcome once its abort of the decode half returned, so after the decode
    # went idle: wait for the count, then check it is exactly one per abandoned request
    wait_until(lambda: decode_idle(stack["d_url"]), "the abandoned request to be aborted")
    wait_until(lambda: aborted() >= 1, "the router to count the abandoned request")
    assert aborted() == 1
    # not streamed: the router notices the closed connection by polling. The tiny model can decode
    # the 2000 tokens the decode holds in about 2 s, so the client leaves after 0.5 s and the router
    # (in this process) polls every 0.05 s: the request is still decoding when it is noticed
    monkeypatch.setattr(router_app, "DISCONNECT_POLL_S", 0.05)
    with pytest.raises(httpx.ReadTimeout):
        http.post(
            f"{stack['url']}/v1/completions", json={**body, "max_tokens": 2000, "stream": False}, timeout=0.5
        )
    wait_until(lambda: decode_idle(stack["d_url"]), "the abandoned non-streaming request to be aborted")
    wait_until(lambda: aborted() >= 2, "the router to count the abandoned non-streaming request")
    assert aborted() == 2


BAD = {
    "unknown model": ({"model": "nope", "prompt": "x"}, 404, "model"),
    "max_tokens 0": ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens -3": ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    "temperature < 0": ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    "top_p 0": ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    "top_p 1.5": ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    "prompt too long": ({"model": "tiny", "prompt": [5] * 3000, "max_tokens": 4}, 400, "prompt"),
    "prompt + max_tokens too long": (
        {"model": "tiny", "prompt": [5] * 100, "max_tokens": 5000},
        400,
        "prompt",
    ),
    "token id outside vocab": ({"model": "tiny", "prompt": [1, 10**6]}, 400, "prompt"),
    "no prompt": ({"model": "tiny"}, 400, "prompt"),
    "n 0": ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    "logprobs 21": ({"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_a_4xx_with_openai_error_body(stack, name):
    body, status, param = BAD[name]
    for stream in (False, True):
        r = http.post(f"{stack['url']}/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    assert http.get(f"{stack['url']}/health").status_code == 200


@pytest.mark.slow
def test_invalid_json_and_openai_client_errors(stack):
    r = http.post(
        f"{stack['url']}/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"], r.text
    r = http.post(f"{stack['url']}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        stack["client"].chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        stack["client"].completions.create(model="tiny", prompt="x", temperature=-1)
    assert [m.id for m in stack["client"].models.list()] == ["tiny"]
    # still serving
    assert complete(stack["client"], [3, 4], stream=False, max_tokens=2)[2] == "length"


def test_no_usable_instance_is_503(model_dir):
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    cfg = RouterConfig(
        model=str(model_dir), prefill=("http://localhost:9",), decode=(dead,), served_model_name="tiny"
    )
    with running_router(cfg) as (url, _):
        assert http.get(f"{url}/live").status_code == 200
        h = http.get(f"{url}/health")
        assert h.status_code == 503 and "no usable" in h.json()["error"]
        for stream in (False, True):
            r = http.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        metrics = http.get(f"{url}/metrics").text
        assert metric(metrics, "pdserve_instance_healthy", instance=dead, role="decode") == 0
        assert metric(metrics, "pdserve_router_requests_total", outcome="unavailable") == 2


def test_router_app_imports_no_torch():
    code = (
        "import json, sys, pdserve.router.app, pdserve.router.admin; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
