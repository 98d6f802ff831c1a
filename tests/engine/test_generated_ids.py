"""A migrated request's earlier output (SamplingParams.generated, contracts._Sampling.generated):
the penalties and the grammar count it as output, exactly as the unbroken request counted it;
min_tokens counts only the request's own tokens; the field is range-checked at the edge."""

from __future__ import annotations

import pytest
import torch

from pdserve import contracts
from pdserve.engine import logits_process
from pdserve.engine.constraint import GrammarError, Grammars, grammar_for
from pdserve.engine.logits_process import RowProcessing
from pdserve.engine.sampler import Sampler
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams

V = 50


@pytest.mark.parametrize(
    "settings",
    [
        {"presence_penalty": 0.5, "frequency_penalty": -0.25},
        {"repetition_penalty": 1.7},
        {"presence_penalty": 1.0, "repetition_penalty": 0.6, "logit_bias": ((3, 2.0),)},
    ],
)
def test_penalties_count_the_generated_ids_as_output(settings):
    prompt, earlier, own = (1, 2, 3), (4, 4, 9, 2), [9, 7]
    unbroken = SamplingParams(max_tokens=16, prompt_ids=prompt, **settings)
    # the continuation's prompt is prompt + earlier, its own output starts after them
    migrated = SamplingParams(max_tokens=10, prompt_ids=prompt + earlier, generated=earlier, **settings)
    want = RowProcessing.of(unbroken, [*earlier, *own], eos_ids=[0])
    assert RowProcessing.of(migrated, own, eos_ids=[0]) == want
    raw = torch.randn(V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = logits_process.process(raw, migrated, own, eos_ids=[0])
    assert torch.equal(got, logits_process.process(raw, unbroken, [*earlier, *own], eos_ids=[0]))


def test_min_tokens_counts_only_the_requests_own_tokens():
    # the router sends min_tokens - k: EOS stays masked until the request's own count reaches it
    p = SamplingParams(max_tokens=8, min_tokens=2, generated=(5, 6, 7))
    assert RowProcessing.of(p, [1], eos_ids=[0]).banned == (0,)
    assert RowProcessing.of(p, [1, 2], eos_ids=[0]).banned == ()


def test_the_grammar_is_advanced_over_the_generated_ids(tiny_checkpoints):
    model_dir = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    tok = Tokenizer.from_pretrained(model_dir)
    eos = tok.eos_token_ids
    grammars = Grammars(model_dir, tok.vocab_size, eos)
    schema = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
    grammar = grammar_for("json_schema", schema)
    sampler = Sampler(grammars, eos)
    p = SamplingParams(max_tokens=32, temperature=1.0, seed=3, grammar=grammar)
    gen, out = torch.Generator().manual_seed(0), []
    for _ in range(6):
        out.append(sampler.sample_row(torch.randn(tok.vocab_size, generator=gen), p, "u", out)[0])
    unbroken = sampler.grammar_mask(p, "u", out)  # the mask for token 7 of the unbroken request
    migrated = SamplingParams(max_tokens=26, temperature=1.0, seed=9, grammar=grammar, generated=tuple(out))
    assert Sampler(grammars, eos).grammar_mask(migrated, "m", []) == unbroken
    # two own tokens later, still the same state as the unbroken request's
    more = [i for i in range(tok.vocab_size) if unbroken[i // 8] >> (i % 8) & 1][:1]
    fresh = Sampler(grammars, eos)
    assert fresh.grammar_mask(migrated, "m", more) == sampler.grammar_mask(p, "u", out + more)
    with pytest.raises(GrammarError):  # ids the grammar refuses fail the request, never sample blind
        bad = SamplingParams(max_tokens=4, grammar=grammar, generated=tuple(tok.encode("nope")))
        Sampler(grammars, eos).grammar_mask(bad, "b", [])


def test_generated_is_range_checked_at_the_edge():
    body = contracts.GenerateRequest(token_ids=[1, 2, 3, 4], generated=3, max_tokens=5)
    params = body.sampling_params(vocab=V, max_tokens=5)
    assert params.generated == (2, 3, 4) and params.prompt_ids == ()
    assert contracts.PrefillRequest(token_ids=[7]).sampling_params(V, 1).generated == ()
    for bad in (4, 5, -1, 1 << 21, "x", 1.5, float("nan")):
        with pytest.raises(ValueError):  # at least one prompt token stays
            contracts.GenerateRequest(token_ids=[1, 2, 3, 4], generated=bad)
    with pytest.raises(ValueError):
        SamplingParams(generated=(-1,))
