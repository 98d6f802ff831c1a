"""The decode step's sampler (engine/batch_sampler.py), the logic rank 0 runs on its device, on CPU
tensors: it equals the CPU sampler (engine/sampler.py `Sampler.sample_row`) token for token and
logprob for logprob over a mix of rows (greedy, seeded temperature / top-k / top-p, penalties,
logit_bias, min_tokens, a grammar's packed mask, logprobs) and several steps, so the per-request
generator streams advance; a step run again redraws the same tokens; a failing row fails alone;
its one-sample draw is torch.multinomial's; it creates no tensor off the logits' device."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.engine import logits_process
from pdserve.engine.batch_sampler import BatchSampler, SampleRow
from pdserve.engine.constraint import Grammars, grammar_for
from pdserve.engine.sampler import Sampler, draw
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams

STEPS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bs") / "m", "glm_moe_dsa", "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def grammars(model_dir, tokenizer) -> Grammars:
    return Grammars(model_dir, tokenizer.vocab_size, tokenizer.eos_token_ids)


def mix(grammar: str | None) -> dict[str, SamplingParams]:
    sp = lambda **kw: SamplingParams(max_tokens=64, **kw)  # noqa: E731
    rows = {
        "greedy": sp(),
        "greedy-logprobs": sp(logprobs=3),
        "temperature": sp(temperature=0.8, seed=1),
        "top-k": sp(temperature=1.0, top_k=5, seed=2, logprobs=0),
        "top-p": sp(temperature=1.3, top_p=0.7, seed=3),
        "all-three": sp(temperature=0.6, top_k=40, top_p=0.9, seed=4, logprobs=20),
        "penalties": sp(
            temperature=1.0,
            seed=5,
            repetition_penalty=1.5,
            prompt_ids=(1, 2, 3, 50, 9999),
            presence_penalty=0.5,
            frequency_penalty=-0.3,
        ),
        "bias-min-tokens": sp(
            temperature=1.0, seed=6, logit_bias=((7, 5.0), (9, -100.0)), min_tokens=4, stop_token_ids=(11,)
        ),
        "greedy-processed": sp(repetition_penalty=2.0, prompt_ids=(4,), logit_bias=((12, 3.0),), logprobs=2),
        "top-k-1": sp(temperature=1.0, top_k=1, seed=8),
        "same-seed": sp(temperature=0.8, seed=1),  # its own stream: "temperature"'s tokens from its logits
    }
    if grammar is not None:
        rows["grammar"] = sp(temperature=1.0, seed=7, grammar=grammar, logprobs=1)
    return rows


def _run(grammars: Grammars, tokenizer: Tokenizer, dtype: torch.dtype, seed: int) -> None:
    vocab, eos = grammars.vocab_size, grammars.eos_ids
    params = mix(grammar_for("regex", "[a-z]{20,40}"))
    ref = Sampler(grammars, eos)  # today's path: one row at a time
    server = Sampler(grammars, eos)  # the decode server's matchers: they give the masks
    batch = BatchSampler()
    outs: dict[str, list[int]] = {rid: [] for rid in params}
    names = list(params)
    gen = torch.Generator().manual_seed(seed)
    for step in range(STEPS):
        logits = (torch.randn(len(params), vocab, generator=gen, dtype=torch.float64) * 3).to(dtype)
        logits[names.index("same-seed")] = logits[names.index("temperature")]
        want = [ref.sample_row(logits[i], p, rid, outs[rid]) for i, (rid, p) in enumerate(params.items())]
        rows = [
            SampleRow.of(rid, p, outs[rid], eos, server.grammar_mask(p, rid, outs[rid]))
            for rid, p in params.items()
        ]
        got = batch.sample(logits, rows)
        assert [(g.token, g.logprob) for g in got] == want, f"step {step}"
        assert all(g.error is None for g in got)
        if step % 3 == 1:  # a step run again (a failed batch re-run) redraws the same tokens
            assert batch.sample(logits, rows) == got
        for (rid, p), g in zip(params.items(), got):
            server.consume(p, rid, g.token)
            outs[rid].append(g.token)
    assert outs["same-seed"] == outs["temperature"]
    assert len(set(outs["temperature"])) > 1  # really sampled
    assert re.fullmatch("[a-z]+", tokenizer.decode(outs["grammar"]))  # the mask was applied
    assert batch.request_ids == sorted(rid for rid, p in params.items() if not p.greedy)
    batch.forget(params)
    assert batch.request_ids == []


@pytest.mark.parametrize("dtype,seed", [(torch.float32, 0), (torch.float64, 1), (torch.bfloat16, 2)])
def test_batched_rows_equal_the_cpu_sampler_step_after_step(grammars, tokenizer, dtype, seed):
    _run(grammars, tokenizer, dtype, seed)


def test_a_failing_row_fails_alone(grammars):
    """Rows the batch flags (no token allowed, probabilities torch.multinomial refuses) and a row
    that makes the batch raise (a malformed mask: every row is then sampled alone) fail alone, each
    with the error the CPU sampler raises; the other rows sample as it does."""
    vocab, eos = grammars.vocab_size, grammars.eos_ids
    params = mix(None)
    logits = torch.randn(len(params) + 3, vocab, generator=torch.Generator().manual_seed(3))
    logits[-2] = float("nan")  # a sampled row of NaN logits
    rows = [SampleRow.of(rid, p, [], eos) for rid, p in params.items()]
    words = (vocab + 31) // 32
    rows += [
        SampleRow("nothing-allowed", 0, 1.0, seed=1, bitmask=bytes(4 * words)),  # a mask of zeros
        SampleRow("nan", 0, 1.0, seed=2),
        SampleRow("bad-mask", 0, 1.0, seed=3, bitmask=bytes(4 * words - 4)),  # one word short
    ]
    with pytest.raises(ValueError) as no_token:
        logits_process.process(logits[-3], SamplingParams(), [], eos, torch.zeros(vocab, dtype=torch.bool))
    with pytest.raises(RuntimeError) as refused:
        Sampler().sample_row(logits[-2], SamplingParams(temperature=1.0, seed=2), "nan")
    for n in (len(rows) - 1, len(rows)):  # flagged in the batch; then the batch raises too
        got = BatchSampler().sample(logits[:n], rows[:n])
        ref = Sampler(eos_ids=eos)
        for i, (rid, p) in enumerate(params.items()):
            assert (got[i].token, got[i].logprob) == ref.sample_row(logits[i], p, rid), (n, rid)
        assert got[-3 if n == len(rows) else -2].error == f"ValueError: {no_token.value}"
        assert got[-2 if n == len(rows) else -1].error == f"RuntimeError: {refused.value}"
        assert all(g.token is None for g in got[len(params) :])
    assert "a grammar mask of" in got[-1].error, got[-1].error


def test_draw_is_torch_multinomials_draw():
    gen = torch.Generator().manual_seed(0)
    for vocab in (2, 37, 5000):
        probs = torch.softmax(torch.randn(4, vocab, generator=gen) * 4, dim=-1)
        probs[1, : vocab // 2] = 0.0  # zeros (a top-k or top-p filter's) never win
        a = [torch.Generator().manual_seed(s) for s in range(4)]
        b = [torch.Generator().manual_seed(s) for s in range(4)]
        for _ in range(3):  # the streams advance the same way
            want = [int(torch.multinomial(probs[i], 1, generator=a[i])) for i in range(4)]
            assert draw(probs, b).tolist() == want


def test_no_tensor_off_the_logits_device(grammars):
    """As tests/engine/test_device_hygiene.py: with torch's default device "meta", a tensor created
    without device= would meet the CPU logits and raise. Results equal a run without it."""
    vocab, eos = grammars.vocab_size, grammars.eos_ids
    params = mix(None)
    mask = Sampler(grammars, eos).grammar_mask(
        SamplingParams(grammar=grammar_for("regex", "[a-z]+")), "g", []
    )
    rows = [SampleRow.of(rid, p, [5, 6, 5], eos) for rid, p in params.items()]
    rows.append(SampleRow("g", 0, 1.0, seed=9, logprobs=2, bitmask=mask))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(4))
    want = BatchSampler().sample(logits, rows)
    torch.set_default_device("meta")
    try:
        got = BatchSampler().sample(logits, rows)
    finally:
        torch.set_default_device(None)
    assert got == want and all(g.error is None for g in got)
