"""The router accepts exactly what its instances accept, with real servers (a prefill, C_p = 1, and a
decode of 64 KV slots in pages of 4) on a checkpoint whose LM head is padded past its tokenizer
(tests/padded_vocab.py: the padded rows would win every step).

  - fit (kvcache/kv_fit.py): a request the decode would refuse gets the router's own 400
    `context_length_exceeded` (and the decode, asked directly, does refuse it); a request it accepts,
    however exactly it fills the cache, runs to its max_tokens;
  - vocabulary (engine/logits_process.py `decodable`): greedy and random sampling emit only ids the
    tokenizer has, and a later turn that sends the generated ids (or text) back is served.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.padded_vocab import make_padded_checkpoint
from tests.router.helpers import decode_idle, router_config, running_router, stop_all, wait_until
from tests.servers import http, start_server

DECODE_SLOTS, PAGE = 64, 4
PROMPT = [5, 6]  # shorter than a page


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    path, real = make_padded_checkpoint(tmp_path_factory.mktemp("padded") / "m")
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(start_server, "prefill", path, "--bootstrap-timeout", "5")
        d = pool.submit(start_server, "decode", path, "--page-size", str(PAGE), max_kv_tokens=DECODE_SLOTS)
    started = [f.result() for f in (p, d) if f.exception() is None]
    if len(started) < 2:
        stop_all([proc for proc, _ in started])
        raise next(f.exception() for f in (p, d) if f.exception() is not None)
    (prefill, p_url), (decode, d_url) = started
    try:
        with running_router(router_config(path, p_url, d_url)) as (url, _):
            wait_until(lambda: http.get(f"{url}/health").status_code == 200, "the router to be ready")
            yield {"url": url, "p_url": p_url, "d_url": d_url, "real": real}
    finally:
        stop_all([prefill, decode])


def _complete(url: str, prompt, **kw):
    body = {"model": "tiny", "prompt": prompt, "ignore_eos": True, "return_token_ids": True, **kw}
    return http.post(f"{url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize(
    "max_tokens, n",
    [
        (8, 6),  # 6 x (2 + 8) = 60 tokens, but 9 slots are 3 pages per choice: 18 pages > 16
        (8, 8),  # one token over 2 pages per choice
        (64, 1),  # one slot over the whole cache
    ],
)
def test_what_the_decode_refuses_is_the_routers_own_400(stack, max_tokens, n):
    r = _complete(stack["url"], PROMPT, max_tokens=max_tokens, n=n)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    direct = http.post(
        f"{stack['d_url']}/v1/generate",
        json={"token_ids": PROMPT, "max_tokens": max_tokens, "n": n, "stream": True},
    )
    assert direct.status_code == 400 and "KV slots" in direct.text, direct.text  # the decode agrees


@pytest.mark.parametrize(
    "max_tokens, n",
    [
        (63, 1),  # 2 + 63 - 1 = 64 slots: the whole cache (n x (prompt + max_tokens) = 65)
        (7, 8),  # 8 slots = 2 pages per choice, 16 pages (n x (prompt + max_tokens) = 72)
    ],
)
def test_what_the_decode_accepts_runs_even_when_it_fills_the_cache(stack, max_tokens, n):
    r = _complete(stack["url"], PROMPT, max_tokens=max_tokens, n=n)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == n
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == max_tokens for c in choices)
    wait_until(lambda: decode_idle(stack["d_url"]), "the decode instance to be idle")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3, "n": 2}])
def test_generated_ids_are_decodable_and_come_back_as_a_later_turn(stack, sampling):
    real = stack["real"]
    first = _complete(stack["url"], PROMPT, max_tokens=8, **sampling)
    assert first.status_code == 200, first.text
    for choice in first.json()["choices"]:
        ids = choice["token_ids"]
        assert len(ids) == 8 and all(0 <= t < real for t in ids), ids
        later = _complete(stack["url"], PROMPT + ids + [7], max_tokens=4, **sampling)
        assert later.status_code == 200, later.text  # the conversation sent back as token ids
        assert all(0 <= t < real for c in later.json()["choices"] for t in c["token_ids"])


def test_a_chat_conversation_goes_on(stack):
    messages = [{"role": "user", "content": "hello there"}]
    for turn in range(2):
        r = http.post(
            f"{stack['url']}/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": messages,
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": turn,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert all(0 <= t < stack["real"] for t in choice["token_ids"])
        messages += [choice["message"], {"role": "user", "content": "and then?"}]


def test_echo_prompt_logprobs_list_no_padded_id(stack):
    """The prefill ranks' prompt logprobs (echo) rank only decodable ids (the padded rows would win)."""
    r = http.post(
        f"{stack['p_url']}/v1/prefill",
        json={"token_ids": PROMPT + [9, 10], "prompt_logprobs": 5},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    entries = [lp for lp in r.json()["prompt_logprobs"] if lp is not None]
    assert len(entries) == 3 and all(len(lp["top"]) == 5 for lp in entries)
    assert all(0 <= t < stack["real"] for lp in entries for t, _ in lp["top"]), entries
