"""Logit processing and logprobs in the sampler (engine/logits_process.py, engine/sampler.py):
logprobs are the float64 log-softmax of the raw logits whatever the sampling settings, top
logprobs sorted; logit_bias, min_tokens, repetition / presence / frequency penalties change the
logits as documented; an llguidance grammar masks every token it does not allow."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine import logits_process
from pdserve.engine.constraint import GrammarError, Grammars, grammar_for
from pdserve.engine.sampler import Sampler
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams

V = 50


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logprobs=5),
        SamplingParams(logprobs=20, temperature=0.7, top_k=3, top_p=0.5, seed=1),
        SamplingParams(logprobs=0, logit_bias=((7, 100.0),), repetition_penalty=1.7),
    ],
)
def test_logprobs_are_the_raw_log_softmax_whatever_the_sampling(params):
    raw = _logits()
    token, lp = Sampler().sample_row(raw, params, "r")
    want = torch.log_softmax(raw, -1)
    assert lp.logprob == want[token].item()  # float64, exactly the same computation
    assert len(lp.top) == params.logprobs
    vals = [v for _, v in lp.top]
    assert vals == sorted(vals, reverse=True)
    assert all(v == want[t].item() for t, v in lp.top)
    if params.logprobs:
        assert lp.top[0][0] == int(raw.argmax())
    if params.logit_bias:
        assert token == 7  # the bias decides the token, not the reported logprob


def test_penalties_bias_and_min_tokens():
    raw = torch.zeros(V, dtype=torch.float64)
    raw[3], raw[4] = 2.0, -2.0
    p = SamplingParams(repetition_penalty=2.0, prompt_ids=(3,))
    out = logits_process.process(raw, p, [4], eos_ids=[0])
    assert out[3] == 1.0 and out[4] == -4.0 and out[5] == 0.0  # divided if positive, multiplied if not
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = logits_process.process(raw, p, [5, 5, 6], eos_ids=[0])
    assert out[5] == -1.0 and out[6] == -0.75 and out[7] == 0.0
    p = SamplingParams(logit_bias=((9, -100.0), (10, 1.5)))
    out = logits_process.process(raw, p, [], eos_ids=[0])
    assert out[9] == -100.0 and out[10] == 1.5
    p = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(11,))
    raw2 = raw.clone()
    raw2[0] = raw2[11] = 50.0  # EOS and a stop id would win
    assert Sampler(eos_ids=[0]).sample_row(raw2, p, "a", [1])[0] == 3  # one token so far: both masked
    assert Sampler(eos_ids=[0]).sample_row(raw2, p, "a", [1, 2])[0] in (0, 11)


def test_extreme_valid_values_never_make_a_nan():
    raw = _logits()
    for p in (
        SamplingParams(repetition_penalty=5e-324, prompt_ids=tuple(range(V)), temperature=1.0, seed=0),
        SamplingParams(repetition_penalty=10.0, prompt_ids=(1, 2), logit_bias=((3, 100.0), (4, -100.0))),
        SamplingParams(presence_penalty=-2.0, frequency_penalty=-2.0, temperature=1e-30, seed=1),
    ):
        out = logits_process.process(raw, p, [1] * 100, eos_ids=[0])
        assert not out.isnan().any()
        token, _ = Sampler().sample_row(raw, p, "x", [1] * 100)
        assert 0 <= token < V


def test_out_of_range_processing_fields_are_refused():
    for bad in (
        {"min_tokens": 5, "max_tokens": 4},
        {"presence_penalty": float("nan")},
        {"frequency_penalty": 2.5},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, float("inf")),)},
        {"logit_bias": ((-1, 1.0),)},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_grammar_masks_every_token_it_does_not_allow(tiny_checkpoints):
    model_dir = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    tok = Tokenizer.from_pretrained(model_dir)
    vocab = tok.vocab_size
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    grammar = grammar_for("json_schema", schema)
    eos = tok.eos_token_ids
    sampler = Sampler(Grammars(model_dir, vocab, eos), eos)
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=3, grammar=grammar)
    out: list[int] = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(64):
        token, _ = sampler.sample_row(torch.randn(vocab, generator=gen), params, "g", out)
        if token in eos:
            break
        out.append(token)
    assert token in eos
    assert set(json.loads(tok.decode(out))) == {"a"}
    with pytest.raises(GrammarError, match="minimum"):
        grammar_for("json_schema", {"type": "integer", "minimum": 5, "maximum": 1})
    with pytest.raises(GrammarError):
        grammar_for("regex", "(unclosed")
