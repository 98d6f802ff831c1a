"""Logprobs through the whole stack in float64 (prefill C_p = 2 -> decode W = C_d = 2, TCP
hand-off) equal the single-rank engine's log-softmax to 1e-8: echo's prompt logprobs (prefill ranks'
own positions), the first token's (prefill, through TransferDone) and the rest (decode ranks)."""

from __future__ import annotations

import openai
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.tokenizer import Tokenizer
from tests.router.helpers import router_config, running_router, start_servers, stop_all
from tests.router.test_openai_api import check_entries, reference_logprobs

TOL = 1e-8


@pytest.fixture(scope="module")
def client64(model_dir):
    f64 = ("--dtype", "float64", "--exact-dtype")  # true float64 on both sides
    started = start_servers(
        model_dir,
        [
            ("prefill", "--cp-size", "2", *f64),
            ("decode", "--tp-size", "2", "--dcp-size", "2", "--dcp-index", "split", "--page-size", "4", *f64),
        ],
    )
    try:
        with running_router(router_config(model_dir, started[0][1], started[1][1])) as (url, _):
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        stop_all([p for p, _ in started])


def test_float64_logprobs_equal_the_single_rank_engine(client64, model_dir):
    engine = LLMEngine.from_pretrained(model_dir, "float64", float32_islands=False)
    for prompt in ([7], [5, 17, 300, 42, 9, 77, 13, 2, 8, 19, 101], [(13 * i) % 500 + 4 for i in range(150)]):
        r = client64.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            logprobs=5,
            echo=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        c = r.choices[0]
        ids = prompt + c.model_extra["token_ids"]
        ref = reference_logprobs(engine, ids)
        lp = c.logprobs
        check_entries(ref, ids[1:], list(zip(lp.token_logprobs[1:], lp.top_logprobs[1:])), TOL)
        for row, top in zip(ref, lp.top_logprobs[1:]):  # (tokens of equal text share one key)
            want = row.topk(5).values.tolist()
            assert all(min(abs(v - w) for w in want) <= TOL for v in top.values())
    tok = Tokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "float64"}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    r = client64.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    out = r.choices[0].model_extra["token_ids"]
    ref = reference_logprobs(engine, prompt + out)[len(prompt) - 1 :]
    for row, token, entry in zip(ref, out, r.choices[0].logprobs.content, strict=True):
        assert abs(entry.logprob - row[token].item()) <= TOL
        want = row.topk(20).values.tolist()
        assert all(abs(t.logprob - w) <= TOL for t, w in zip(entry.top_logprobs, want, strict=True))
