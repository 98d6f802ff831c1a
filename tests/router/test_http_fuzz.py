"""Thousands of random and malformed requests to each HTTP API (router completions, chat with and
without tools / structured output / n > 1 / logprobs, prefill, decode, abort), drawn from the
session's fuzz seed (tests/conftest.py: new every run, printed, PDSERVE_FUZZ_SEED=S reruns it).

Bodies are random bytes, random JSON of every shape, and mutations of valid bodies (fields
dropped, retyped, made huge, NaN, nested deep, a value deep inside `tools` or `response_format`
replaced); content types and methods vary. No answer may be a 5xx, and afterwards every server is
healthy, idle, and a normal request is exact.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.router.helpers import decode_idle, router_config, running_router, wait_until
from tests.servers import AUTH, http

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SHAPE = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
VALID = {  # name: (path, a valid body, how many requests: 6,000 in all cost what 8,500 simpler ones did)
    "router": (
        "/v1/completions",
        {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "n": 2, "logprobs": 2},
        1000,
    ),
    "chat": ("/v1/chat/completions", CHAT, 300),
    "chat-tools": (
        "/v1/chat/completions",
        {**CHAT, "tools": [TOOL], "tool_choice": "auto", "n": 2, "logprobs": True, "top_logprobs": 2},
        700,
    ),
    "chat-format": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SHAPE}}},
        700,
    ),
    "prefill": ("/v1/prefill", {"token_ids": [5, 6, 7], "temperature": 0.5, "seed": 3}, 1500),
    "decode": ("/v1/generate", {"token_ids": [5, 6, 7], "max_tokens": 2, "stream": False}, 1500),
    "abort": ("/v1/abort", {"request_id": "nothing-here"}, 300),
}
FIELDS = [  # besides each body's own: what any API might be sent
    "extra",
    "max_tokens",
    "seed",
    "stream",
    "top_k",
    "stop",
    "n",
    "response_format",
    "tools",
    "tool_choice",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stop_token_ids",
    "min_tokens",
    "stream_options",
    "best_of",
    "echo",
    "prompt_logprobs",
    "request_id",
    "bootstrap",
    "handoff",
]
ODD = [
    None,
    True,
    -1,
    0,
    2**64,
    -(2**70),
    1e308,
    1.5,
    "",
    "x" * 3000,
    "NaN",
    [],
    {},
    [1, "a", None],
    {"a": [1]},
    "\u0000\ud7ff",
    10**40,
]


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice(ODD)
    if kind == 1:
        return rng.randint(-(2**70), 2**70)
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind == 3:
        return "".join(chr(rng.randrange(0x20, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 4:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {str(_random_json(rng, 3))[:20]: _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def _mutate_deep(rng: random.Random, value):
    """`value` with one thing somewhere inside it (a dict's key or a list's item) replaced."""
    if isinstance(value, dict) and value:
        key = rng.choice(list(value))
        return {**value, key: _mutate_deep(rng, value[key]) if rng.randrange(3) else rng.choice(ODD)}
    if isinstance(value, list) and value:
        i = rng.randrange(len(value))
        return (
            value[:i]
            + [_mutate_deep(rng, value[i]) if rng.randrange(3) else _random_json(rng)]
            + value[i + 1 :]
        )
    return rng.choice(ODD) if rng.randrange(2) else _random_json(rng)


def _mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(list(body) * 2 + FIELDS)
        action = rng.randrange(5)
        if action == 0:
            body.pop(key, None)
        elif action == 4:
            body[key] = _mutate_deep(rng, body.get(key))
        elif action == 1:
            body[key] = rng.choice(ODD)
        elif action == 2:
            body[key] = _random_json(rng)
        else:
            body[key] = [body.get(key)] * rng.randrange(1, 4)
    if isinstance(body.get("max_tokens"), int) and 2 < body["max_tokens"] <= 1 << 20:
        body["max_tokens"] = 2  # the fuzz is about input, not throughput
    if isinstance(body.get("n"), int) and 2 < body["n"] <= 1 << 20:
        body["n"] = 2
    return body


def _request(rng: random.Random, path: str, valid: dict) -> dict:
    kind = rng.randrange(10)
    headers = {"content-type": "application/json"}
    if kind == 0:
        content = rng.randbytes(rng.randrange(200))
    elif kind == 1:
        content = json.dumps(_random_json(rng)).encode()
    elif kind == 2:
        content = json.dumps(valid).encode()[: rng.randrange(40)]  # cut short
    elif kind == 3:
        depth = rng.randrange(100, 3000)
        content = ("[" * depth + "]" * depth).encode()
    elif kind == 4:
        content = (
            json.dumps(_mutate(rng, valid)).encode().replace(b"0.5", b"NaN").replace(b'"tiny"', b"Infinity")
        )
    else:
        content = json.dumps(_mutate(rng, valid)).encode()
    if rng.randrange(12) == 0:
        headers["content-type"] = rng.choice(
            ["text/plain", "application/x-www-form-urlencoded", "", "multipart/form-data"]
        )
    method = "POST" if rng.randrange(20) else rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    return {"method": method, "url": path, "content": content, "headers": headers}


async def _fire(base: str, path: str, valid: dict, seed: int, n: int) -> dict[int, int]:
    """Sends n requests drawn from `seed`; {status: count}; a 5xx or no answer fails, naming the seed."""
    rng = random.Random(seed)
    seen: dict[int, int] = {}
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as client:

        async def one(req):
            async with sem:
                try:
                    r = await client.request(**req)
                except httpx.TransportError as e:  # no answer at all: name the server and the request
                    raise AssertionError(
                        (f"seed {seed}", base, req["method"], repr(e), req["content"][:300])
                    ) from e
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (f"seed {seed}", r.status_code, r.text[:300], req["content"][:300])

        await asyncio.gather(*(one(_request(rng, path, valid)) for _ in range(n)))
    return seen


@pytest.mark.slow
def test_thousands_of_malformed_requests_per_api(model_dir, instances, fuzz_seed):
    p_url, d_url = instances
    cfg = router_config(
        model_dir,
        p_url,
        d_url,
        max_body_bytes=1 << 20,
    )
    with running_router(cfg) as (url, _):
        targets = {"prefill": p_url, "decode": d_url, "abort": d_url}
        for i, (name, (path, valid, n)) in enumerate(VALID.items()):
            seen = asyncio.run(_fire(targets.get(name, url), path, valid, seed=fuzz_seed * 10 + i, n=n))
            assert sum(seen.values()) >= n and any(400 <= s < 500 for s in seen), (name, seen)
            assert seen.get(200, 0) > 0 or name == "abort", (name, seen)  # near-valid bodies are served too
            for base in (url, p_url, d_url):
                assert http.get(f"{base}/health", timeout=10).status_code == 200, (name, base)
        wait_until(lambda: decode_idle(d_url), "the decode instance to be idle", 60)
        ids = [5, 6, 7, 8]
        want = LLMEngine.from_pretrained(model_dir).generate(
            [ids], SamplingParams(max_tokens=6, ignore_eos=True)
        )[0]
        r = http.post(
            f"{url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": ids,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=60,
        )
        assert r.json()["choices"][0]["token_ids"] == want
