"""The OpenAI API beyond plain sampling, with the official `openai` client against the router in
front of a real prefill (C_p = 2) and decode (W = C_d = 2) instance: logprobs equal the single-rank
engine's log-softmax (the first token's from the prefill through the hand-off, the rest from the
decode ranks; echo's prompt logprobs from the prefill), structured outputs validate against their
schema, penalties / logit_bias / min_tokens / stop_token_ids act, and unknown or unsupported fields
are 400s naming them."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.tokenizer import Tokenizer
from tests.router.helpers import router_config, running_router
from tests.router.test_tool_parsers import TEMPLATES, TOOLS
from tests.servers import http

TOL = 1e-4  # the float32 stack against the float32 single-rank engine (float64 and 1e-8: --deep)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
    },
    "required": ["name", "ok", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def api(model_dir, instances):
    cfg = router_config(model_dir, *instances, report_cached_tokens=True)  # usage's cached_tokens
    with running_router(cfg) as (url, _):
        yield {
            "url": url,
            "client": openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60),
            "tok": Tokenizer.from_pretrained(model_dir),
            "engine": LLMEngine.from_pretrained(model_dir),
        }


def reference_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: row t is log p(. | ids[: t + 1]) under the single-rank engine, in float64."""
    return torch.log_softmax(engine.prefill_logits(ids)[:-1].double(), dim=-1)


def check_entries(ref: torch.Tensor, next_ids: list[int], entries: list[tuple[float, dict]], tol: float):
    """entries[i] = (logprob of next_ids[i], {token text: logprob} of the top) against ref rows."""
    for row, token, (lp, top) in zip(ref, next_ids, entries):
        assert abs(lp - row[token].item()) <= tol
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert abs(max(top.values()) - row.max().item()) <= tol  # the top entry is the most likely token
        assert lp <= max(top.values()) + tol


@pytest.mark.slow
def test_completion_logprobs_and_echo_equal_the_single_rank_engine(api):
    client, tok, prompt = api["client"], api["tok"], [5, 17, 300, 42, 9, 77, 13]
    for stream in (False, True):
        kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True)
        extra = {"ignore_eos": True, "return_token_ids": True}
        if stream:
            chunks = list(client.completions.create(**kw, stream=True, extra_body=extra))
            lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
            tokens_lp = sum((lp.token_logprobs for lp in lps), [])
            tops = sum((lp.top_logprobs for lp in lps), [])
            out = sum((c.choices[0].model_extra.get("token_ids") or [] for c in chunks), [])
            offsets = sum((lp.text_offset for lp in lps), [])
        else:
            r = client.completions.create(**kw, extra_body=extra)
            c = r.choices[0]
            tokens_lp, tops, out = (
                c.logprobs.token_logprobs,
                c.logprobs.top_logprobs,
                c.model_extra["token_ids"],
            )
            offsets = c.logprobs.text_offset
            assert c.text.startswith(tok.decode(prompt))
        ids = prompt + out
        assert len(tokens_lp) == len(ids) and tokens_lp[0] is None and tops[0] is None
        assert offsets == sorted(offsets)
        ref = reference_logprobs(api["engine"], ids)
        check_entries(ref, ids[1:], list(zip(tokens_lp[1:], tops[1:])), TOL)
        assert out == [int(ref[len(prompt) - 1 + i].argmax()) for i in range(len(out))]  # greedy


@pytest.mark.slow
def test_chat_logprobs_streamed_or_not(api):
    client, tok = api["client"], api["tok"]
    messages = [{"role": "user", "content": "logprobs please"}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    kw = dict(model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=4)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.chat.completions.create(**kw, extra_body=extra)
    out = r.choices[0].model_extra["token_ids"]
    content = r.choices[0].logprobs.content
    assert len(content) == len(out) == 5 and all(len(e.top_logprobs) == 4 for e in content)
    ref = reference_logprobs(api["engine"], prompt + out)[len(prompt) - 1 :]
    check_entries(
        ref,
        out,
        [(e.logprob, {t.token + str(i): t.logprob for i, t in enumerate(e.top_logprobs)}) for e in content],
        TOL,
    )
    streamed = [
        e
        for c in client.chat.completions.create(**kw, stream=True, extra_body=extra)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]
    assert "".join(e.token for e in content) == r.choices[0].message.content


@pytest.mark.slow
def test_json_schema_outputs_always_validate(api):
    client = api["client"]
    fmt = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SCHEMA, "strict": True}}

    def one(seed: int) -> str:
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a shirt"}],
            max_tokens=48,
            seed=seed,
            temperature=1.0,
            response_format=fmt,
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(100)))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one forced answer
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=16,
        temperature=1.0,
        seed=3,
        extra_body={"response_format": {"type": "regex", "regex": "[ab]{3}"}},
    )
    assert r.choices[0].text in {a + b + c for a in "ab" for b in "ab" for c in "ab"}


@pytest.mark.slow
def test_sampling_controls_act(api):
    client, tok = api["client"], api["tok"]
    base = dict(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    forced = client.completions.create(**base, logit_bias={"42": 100}, extra_body={"return_token_ids": True})
    assert (
        forced.choices[0].model_extra["token_ids"] == [42] * 4
    )  # the first from the prefill, the rest decode
    rep = client.completions.create(
        **base, logit_bias={"42": 8}, frequency_penalty=2.0, extra_body={"return_token_ids": True}
    )
    assert (
        rep.choices[0].model_extra["token_ids"][0] == 42
        and rep.choices[0].model_extra["token_ids"] != [42] * 4
    )
    stop = client.completions.create(
        **base, logit_bias={"42": 100}, extra_body={"stop_token_ids": [42], "return_token_ids": True}
    )
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 1
    eos = tok.eos_token_ids[0]
    late = client.completions.create(
        **base, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3, "return_token_ids": True}
    )
    ids = late.choices[0].model_extra["token_ids"]
    assert eos not in ids[:3] and ids[3] == eos and late.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**base, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.total_tokens == 7


def test_usage_reports_the_prefill_prefix_cache_hit(api):
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefill's prefix cache served
    (whole 16-token pages of all but the last prompt token), streamed and not."""
    client = api["client"]
    kw = dict(model="tiny", prompt=list(range(300, 340)), max_tokens=2, temperature=0.0)
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text


def transfer_bytes(d_url: str) -> int:
    """The hand-offs' payload: rows sent, plus those the decode instance's prefix cache already held."""
    cap = http.get(f"{d_url}/capacity").json()
    return cap["transfer_bytes"] + cap["transfer_skipped_bytes"]


@pytest.mark.slow
def test_n_choices_from_one_prefill_are_reproducible_and_transfer_once(api, instances):
    client, d_url = api["client"], instances[1]
    prompt = [9, 8, 7, 6, 5, 4, 3]
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=21)
    extra = {"ignore_eos": True, "return_token_ids": True}

    def ids(r) -> list[list[int]]:
        assert [c.index for c in r.choices] == list(range(len(r.choices)))
        return [c.model_extra["token_ids"] for c in r.choices]

    before = transfer_bytes(d_url)
    one = client.completions.create(**kw, extra_body=extra)
    single_bytes = transfer_bytes(d_url) - before
    before = transfer_bytes(d_url)
    four = client.completions.create(**kw, n=4, extra_body=extra)
    assert transfer_bytes(d_url) - before == single_bytes > 0  # one prefill, one hand-off
    assert ids(four)[0] == ids(one)[0] and len({tuple(x) for x in ids(four)}) == 4
    assert four.usage.completion_tokens == 24
    assert ids(client.completions.create(**kw, n=4, extra_body=extra)) == ids(four)  # reproducible
    scored = client.completions.create(**kw, n=4, logprobs=0, extra_body=extra)
    assert ids(scored) == ids(four)
    sums = [sum(c.logprobs.token_logprobs) for c in scored.choices]
    best = client.completions.create(**kw, n=2, best_of=4, extra_body=extra)
    want = sorted(range(4), key=lambda i: -sums[i])[:2]
    assert ids(best) == [ids(four)[i] for i in want] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 24  # every generated token counts
    third = client.completions.create(**{**kw, "seed": 23}, extra_body=extra)
    assert ids(third)[0] == ids(four)[2]  # choice i samples with seed + i
    chunks = list(client.completions.create(**kw, n=4, stream=True, extra_body=extra))
    streamed = [[] for _ in range(4)]
    for ch in chunks:
        for c in ch.choices:
            streamed[c.index] += c.model_extra.get("token_ids") or []
    assert streamed == ids(four)
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "n"}], max_tokens=3, n=2, seed=1, temperature=1.0
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(
        c.message.role == "assistant" for c in chat.choices
    )


BAD = {
    "unknown field": ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    "suffix": ({"prompt": "x", "suffix": "y"}, "suffix"),
    "n 200": ({"prompt": "x", "n": 200}, "n"),
    "best_of < n": ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    "best_of streamed": ({"prompt": "x", "n": 2, "best_of": 3, "stream": True}, "best_of"),
    "logprobs 21": ({"prompt": "x", "logprobs": 21}, "logprobs"),
    "penalty nan": ({"prompt": "x", "presence_penalty": "NaN"}, "presence_penalty"),
    "bias key": ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    "bias huge": ({"prompt": "x", "logit_bias": {"3": 1e9}}, "logit_bias"),
    "bias id": ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias"),
    "min_tokens": ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    "stop id": ({"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
    "bad schema": (
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "nonsense"}},
            },
        },
        "response_format",
    ),
    "bad regex": ({"prompt": "x", "response_format": {"type": "regex", "regex": "(a"}}, "response_format"),
    "format type": ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
    # found by the HTTP fuzz: a list as the type was a 500 (unhashable in the set lookup)
    "format type list": ({"prompt": "x", "response_format": {"type": ["text"]}}, "response_format.type"),
}


@pytest.mark.slow
def test_unknown_and_unsupported_fields_are_400s_naming_them(api):
    for name, (body, param) in BAD.items():
        r = http.post(f"{api['url']}/v1/completions", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == param, (name, r.text)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in (
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"audio": {}}, "audio"),
        ({"echo": True}, "echo"),
    ):
        r = http.post(f"{api['url']}/v1/chat/completions", json={**chat, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def glm_api(model_dir, instances, tmp_path_factory):
    """The router with GLM-5's markup: the model directory with tests/data/templates/glm_moe_dsa.jinja."""
    d = tmp_path_factory.mktemp("glm5") / "model"
    shutil.copytree(model_dir, d)
    shutil.copy(TEMPLATES / "glm_moe_dsa.jinja", d / "chat_template.jinja")
    with running_router(router_config(d, *instances)) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.slow
def test_forced_tool_call_parses_into_tool_calls_streamed_or_not(glm_api):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=400,  # the tiny vocabulary spells the markup almost letter by letter
        temperature=1.0,
        seed=5,
    )
    r = glm_api.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(args) == {"city", "days", "units"} and 1 <= args["days"] <= 9 and args["units"] in ("c", "f")
    assert isinstance(args["city"], str) and len(args["city"]) <= 8
    assert c.message.model_extra.get("reasoning_content") is None  # forced: no reasoning
    chunks = list(glm_api.chat.completions.create(**kw, stream=True))
    streamed = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (0, "get_weather", args)  # the same seed: the same call
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_reasoning_content_is_split_out(glm_api):
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "think"}],
        max_tokens=24,
        temperature=1.0,
        seed=2,
        extra_body={"response_format": {"type": "regex", "regex": "[a-z]{1,6}</think>[a-z]{1,6}"}},
    )
    m = glm_api.chat.completions.create(**kw).choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning.isalpha() and m.content.isalpha() and "<" not in m.content
    chunks = list(glm_api.chat.completions.create(**kw, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == m.content
