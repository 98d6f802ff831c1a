"""Streams that survive their decode instance (router/migration.py, issue 41 item 3).

The bookkeeping on its own: what a choice's continuation asks for (prompt + the tokens it sent,
max_tokens and min_tokens less those, the derived seed, n = 1), which choices finished, the merge
of continuations. Then end to end through the router in front of the real prefill and decode
instances, with a flaky link (tests/router/flaky_link.py) between the router and the decode that
breaks a stream after a planned number of tokens, answers that the request was lost, or stalls
and fails its health check: the client gets one unbroken answer equal to the unbroken run's
(greedy; penalties, min_tokens, logprobs, a stop string and a grammar included), a seeded n = 2
request continues each choice exactly as the documented fresh request, usage counts each token
once, the migrations are counted by cause, a budget of migrations ends a request that keeps
failing with a clean error, and the decode instance ends idle.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.contracts import FinishEvent, TokenEvent
from pdserve.request import SEED_LIMIT, SamplingParams
from pdserve.router.migration import CAUSES, Progress, continued_seed, merge
from tests.router.flaky_link import flaky_link
from tests.router.helpers import decode_idle, metric, router_config, running_router, wait_until

PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 31]


def test_a_continuation_asks_for_the_rest_of_its_choice():
    params = SamplingParams(
        max_tokens=10, temperature=0.8, seed=SEED_LIMIT - 1, min_tokens=4, n=3, logprobs=2, prompt_logprobs=1
    )
    progress = Progress(PROMPT, params, eos_ids=[0])
    for index, token in ((0, 11), (1, 12), (0, 13), (2, 14)):
        progress.record(TokenEvent(token=token, index=index))
    progress.record(FinishEvent(finish_reason="stop", request_id="r", index=2))
    assert progress.unfinished([0, 1, 2]) == [0, 1]
    prompt, p = progress.continuation(0)
    assert prompt == PROMPT + [11, 13] and progress.prompt == PROMPT
    assert (p.max_tokens, p.min_tokens, p.n, p.generated, p.prompt_logprobs) == (8, 2, 1, (11, 13), None)
    assert p.seed == continued_seed(SEED_LIMIT - 1, 2) and p.logprobs == 2 and p.temperature == 0.8
    prompt, p = progress.continuation(1)  # choice 1: its own seed stream, seed + 1 (mod the limit)
    assert prompt == PROMPT + [12] and p.seed == continued_seed(0, 1) and p.min_tokens == 3
    for _ in range(9):
        progress.record(TokenEvent(token=20, index=1))
    assert progress.ended(1) == "length" and progress.ended(0) is None
    with pytest.raises(ValueError):
        progress.continuation(1)  # nothing left to ask for: its finish is given, not run


def test_a_sent_stop_token_or_eos_ended_its_choice():
    progress = Progress(PROMPT, SamplingParams(max_tokens=5, stop_token_ids=(9,), n=3), eos_ids=[0])
    for index, token in ((0, 9), (1, 0), (2, 4)):
        progress.record(TokenEvent(token=token, index=index))
    assert [progress.ended(i) for i in range(3)] == ["stop", "stop", None]
    ignoring = Progress(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), eos_ids=[0])
    ignoring.record(TokenEvent(token=0))
    assert ignoring.ended(0) is None


def test_continued_seeds_are_reproducible_and_in_range():
    assert continued_seed(None, 5) is None and continued_seed(7, 0) == 7  # nothing sent: as it was
    seeds = {continued_seed(s, k) for s in (0, 1, SEED_LIMIT - 1) for k in (1, 2, 64)}
    assert len(seeds) == 9 and all(0 <= s < SEED_LIMIT for s in seeds)
    assert continued_seed(123, 20) == continued_seed(123, 20)


def test_merge_interleaves_and_a_failure_closes_the_rest():
    closed = []

    async def gen(name, n, fail=False, linger_s=0.0):
        try:
            for i in range(n):
                await asyncio.sleep(0.001)
                yield (name, i)
            if fail:
                raise RuntimeError(name)
            await asyncio.sleep(linger_s)
        finally:
            closed.append(name)

    async def run(streams):
        return [e async for e in merge(streams)]

    async def main():
        got = await run([gen("a", 3), gen("b", 2)])
        assert sorted(got) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
        assert [e for e in got if e[0] == "a"] == [("a", 0), ("a", 1), ("a", 2)]  # each in its order
        closed.clear()
        with pytest.raises(RuntimeError, match="b"):
            await run([gen("a", 5, linger_s=10), gen("b", 2, fail=True)])
        await asyncio.sleep(0.01)
        assert sorted(closed) == ["a", "b"]

    asyncio.run(main())


@pytest.fixture(scope="module")
def stack(model_dir, instances):
    p_url, d_url = instances
    with flaky_link(d_url) as (link, link_url):
        with running_router(router_config(model_dir, p_url, link_url)) as (url, app):
            wait_until(lambda: http_ok(f"{url}/health"), "the router to see its instances")
            yield {"url": url, "app": app, "link": link, "d_url": d_url}


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=5).status_code == 200


def stream(stack, **body) -> dict:
    """One streamed completion: {"ids": per choice, "text": per choice, "reasons", "usage", "lps", "error"}."""
    body = {"model": "tiny", "prompt": PROMPT, "stream": True, "return_token_ids": True, **body}
    body.setdefault("stream_options", {"include_usage": True})
    n = body.get("n", 1)
    out = {
        "ids": [[] for _ in range(n)],
        "text": [""] * n,
        "reasons": [None] * n,
        "lps": [[] for _ in range(n)],
    }
    out.update(usage=None, error=None)
    with httpx.stream("POST", f"{stack['url']}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
            for c in event.get("choices", []):
                i = c["index"]
                out["ids"][i] += c.get("token_ids") or []
                out["text"][i] += c["text"]
                out["reasons"][i] = c["finish_reason"] or out["reasons"][i]
                out["lps"][i] += (c.get("logprobs") or {}).get("token_logprobs") or []
            out["usage"] = event.get("usage") or out["usage"]
    return out


def migrations(stack) -> dict[str, float]:
    text = httpx.get(f"{stack['url']}/metrics", timeout=10).text
    return {c: metric(text, "pdserve_router_migrations_total", cause=c) for c in CAUSES}


def broken(stack, plan: list[tuple[str, int]], **body) -> dict:
    """The same request with the flaky link's `plan` for its next decode streams."""
    stack["link"].plan = list(plan)
    try:
        return stream(stack, **body)
    finally:
        stack["link"].plan = []


@pytest.mark.parametrize("mode", ["cut", "lost", "stall"])
def test_a_greedy_stream_survives_its_decode_exactly(stack, mode):
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    unbroken = stream(stack, **body)
    before = migrations(stack)
    first = len(stack["link"].forwarded)
    got = broken(stack, [(mode, 7)], **body)
    assert got["error"] is None and got["ids"] == unbroken["ids"] and got["text"] == unbroken["text"]
    assert len(stack["link"].tokens(first)) == 7  # the fault came after 7 tokens reached the router
    assert got["usage"]["completion_tokens"] == 24 and got["usage"]["prompt_tokens"] == len(PROMPT)
    cause = {"cut": "stream_broken", "lost": "lost", "stall": "health"}[mode]
    after = migrations(stack)
    assert {c: after[c] - before[c] for c in CAUSES} == {c: float(c == cause) for c in CAUSES}


def test_penalties_min_tokens_logprobs_and_a_stop_string_continue(stack):
    body = {
        "max_tokens": 30,
        "temperature": 0,
        "presence_penalty": 1.5,
        "frequency_penalty": 1.0,
        "repetition_penalty": 1.3,
        "min_tokens": 20,
        "logprobs": 2,
    }
    unbroken = stream(stack, **body)
    got = broken(stack, [("cut", 9)], **body)
    assert got["ids"] == unbroken["ids"] and got["text"] == unbroken["text"]
    assert got["lps"][0] == pytest.approx(unbroken["lps"][0], abs=1e-4)
    stop = unbroken["text"][0][-6:-3]  # a stop string past the fault: the text stream's state carries on
    body["stop"] = [stop]
    unbroken = stream(stack, **body)
    got = broken(stack, [("lost", 4)], **body)
    assert got["text"] == unbroken["text"] and got["reasons"] == unbroken["reasons"] == ["stop"]


def test_a_grammar_continues_from_the_sent_tokens(stack):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"max_tokens": 20, "temperature": 0, "response_format": fmt}
    unbroken = stream(stack, **body)
    assert unbroken["ids"][0]
    got = broken(stack, [("cut", 3)], **body)
    assert got["ids"] == unbroken["ids"] and got["error"] is None


def test_seeded_choices_continue_as_the_documented_fresh_request(stack):
    body = {"max_tokens": 16, "temperature": 1.0, "seed": 4321, "n": 2, "ignore_eos": True}
    first = len(stack["link"].forwarded)
    got = broken(stack, [("lost", 9)], **body)
    assert got["error"] is None and got["usage"]["completion_tokens"] == 32
    for i in range(2):
        sent = stack["link"].tokens(first, i)  # what the router had of choice i when it was lost
        k = len(sent)
        assert got["ids"][i][:k] == sent and len(got["ids"][i]) == 16
        fresh = stream(
            stack,
            prompt=PROMPT + sent,
            max_tokens=16 - k,
            temperature=1.0,
            seed=continued_seed(4321 + i, k),
            ignore_eos=True,
        )
        assert got["ids"][i][k:] == fresh["ids"][0], (i, k)


def test_the_migration_budget_ends_a_request_that_keeps_failing(stack):
    orch = stack["app"].state.router.orch
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    got = broken(stack, [("lost", 2)] * 4, **body)  # the original and its three continuations
    assert got["error"] and "after 3 migrations" in got["error"]["message"]
    assert len(got["ids"][0]) <= 8  # 2 from each; text still held back by the detokenizer is not sent
    orch.max_migrations = 0
    try:
        got = broken(stack, [("cut", 2)], **body)  # --max-migrations 0: the error of old
        assert got["error"] and len(got["ids"][0]) <= 2
    finally:
        orch.max_migrations = 3
    wait_until(lambda: decode_idle(stack["d_url"]), "the decode instance to end idle", 30)
