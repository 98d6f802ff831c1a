"""2,500 random and malformed requests to each HTTP API (router, prefill, decode), seeded.

Bodies are random bytes, random JSON of every shape, and mutations of valid bodies (fields
dropped, retyped, made huge, NaN, nested deep); content types and methods vary. No answer may be a
5xx, and afterwards every server is healthy, idle, and a normal request is exact.
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

PER_API = 2500  # make test must stay under 12 minutes: 5,000 took 50 s of it
VALID = {
    "router": ("/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}),
    "chat": (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    "prefill": ("/v1/prefill", {"token_ids": [5, 6, 7], "temperature": 0.5, "seed": 3}),
    "decode": ("/v1/generate", {"token_ids": [5, 6, 7], "max_tokens": 2, "stream": False}),
    "abort": ("/v1/abort", {"request_id": "nothing-here"}),
}
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


def _mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.randrange(1, 4)):
        key = rng.choice(list(body) + ["extra", "max_tokens", "seed", "stream", "top_k", "stop"])
        action = rng.randrange(4)
        if action == 0:
            body.pop(key, None)
        elif action == 1:
            body[key] = rng.choice(ODD)
        elif action == 2:
            body[key] = _random_json(rng)
        else:
            body[key] = [body.get(key)] * rng.randrange(1, 4)
    if isinstance(body.get("max_tokens"), int) and 2 < body["max_tokens"] <= 1 << 20:
        body["max_tokens"] = 2  # the fuzz is about input, not throughput
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
    rng = random.Random(seed)
    seen: dict[int, int] = {}
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as client:

        async def one(req):
            async with sem:
                try:
                    r = await client.request(**req)
                except httpx.TransportError as e:  # no answer at all: name the server and the request
                    raise AssertionError((base, req["method"], repr(e), req["content"][:300])) from e
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (r.status_code, r.text[:300], req["content"][:300])

        await asyncio.gather(*(one(_request(rng, path, valid)) for _ in range(n)))
    return seen


@pytest.mark.slow
def test_thousands_of_malformed_requests_per_api(model_dir, instances):
    p_url, d_url = instances
    cfg = router_config(
        model_dir,
        p_url,
        d_url,
        max_body_bytes=1 << 20,
    )
    with running_router(cfg) as (url, _):
        targets = {"router": url, "chat": url, "prefill": p_url, "decode": d_url, "abort": d_url}
        for i, (name, (path, valid)) in enumerate(VALID.items()):
            n = (
                PER_API if name in ("router", "prefill", "decode") else PER_API // 5
            )  # chat, abort: same edges
            seen = asyncio.run(_fire(targets[name], path, valid, seed=i, n=n))
            assert sum(seen.values()) >= n and any(400 <= s < 500 for s in seen), (name, seen)
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
