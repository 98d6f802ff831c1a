"""One vocabulary rule: the samplers never emit an id the tokenizer cannot decode (an LM head padded
past the tokenizer: model/tokenizer.py `decodable_vocab`, engine/logits_process.py `decodable`), so
every id a model emits is one the router and the instances accept back (router/prompt.py checks
prompt ids against the tokenizer's size). Checked on logits whose padded columns would win, in both
samplers (the CPU one: a prefill's first tokens, the single-rank engine; the batched one: a decode
step's rank 0), on a checkpoint whose padded LM-head rows win every step when nothing masks them,
and as a no-op on an unpadded model (its outputs, compared with Hugging Face elsewhere, unchanged)."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine import logits_process
from pdserve.engine.batch_sampler import BatchSampler, SampleRow
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import Sampler
from pdserve.model.tokenizer import decodable_vocab
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.engine.test_batch_sampler import mix
from tests.padded_vocab import make_padded_checkpoint
from tests.reference import free_port

REAL, PADDED = 40, 64  # the tokenizer's ids, the LM head's rows


def _padded_logits(rows: int, seed: int) -> torch.Tensor:
    """[rows, PADDED] logits whose padded columns are the largest by far."""
    logits = torch.randn(rows, PADDED, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logits[:, REAL:] += 50.0
    return logits


def test_both_samplers_never_emit_nor_report_a_padded_id():
    params = mix(None)  # greedy, seeded temperature / top-k / top-p, penalties, bias, logprobs
    params["bias-on-padding"] = SamplingParams(temperature=1.0, seed=9, logit_bias=((REAL + 1, 100.0),))
    cpu, batch = Sampler(eos_ids=(0,), vocab_limit=REAL), BatchSampler(vocab_limit=REAL)
    outs: dict[str, list[int]] = {rid: [] for rid in params}
    for step in range(20):
        logits = _padded_logits(len(params), step)
        assert (logits.argmax(-1) >= REAL).all()  # unmasked, every row's best id is padding
        want = [cpu.sample_row(logits[i], p, rid, outs[rid]) for i, (rid, p) in enumerate(params.items())]
        got = batch.sample(logits, [SampleRow.of(rid, p, outs[rid], (0,)) for rid, p in params.items()])
        assert [(g.token, g.logprob) for g in got] == want  # the batched form is still the CPU one
        for (rid, _), (token, lp) in zip(params.items(), want):
            assert 0 <= token < REAL, (rid, token)
            assert lp is None or all(t < REAL for t, _ in lp.top)
            outs[rid].append(token)
        greedy = Sampler(vocab_limit=REAL).sample(logits, [SamplingParams()] * len(params), list(params))
        assert max(greedy) < REAL  # the fast greedy path too
    assert len(set(outs["temperature"])) > 1  # really sampled


def test_unpadded_logits_are_untouched():
    logits = _padded_logits(3, 0)
    assert logits_process.decodable(logits, PADDED) is logits
    assert logits_process.decodable(logits, None) is logits
    masked = logits_process.decodable(logits, REAL)
    assert torch.equal(masked[:, :REAL], logits[:, :REAL]) and (masked[:, REAL:] == float("-inf")).all()
    p = SamplingParams(temperature=0.9, seed=3, logprobs=5)
    assert Sampler(vocab_limit=PADDED).sample_row(logits[0], p, "a") == Sampler().sample_row(
        logits[0], p, "a"
    )


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return make_padded_checkpoint(tmp_path_factory.mktemp("padded") / "m")


def test_decodable_vocab_reads_the_tokenizer(padded, tiny_checkpoints, tmp_path):
    path, real = padded
    assert decodable_vocab(path, 2 * real) == real
    unpadded = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    assert decodable_vocab(unpadded, 512) == 512  # the tiny presets are not padded: nothing masked
    assert decodable_vocab(tmp_path, 77) == 77  # no tokenizer.json: every row is a token


def test_a_padded_checkpoint_generates_only_decodable_ids(padded):
    path, real = padded
    prompts = [[5, 9, 100], [300, 2, 7, 8, 11]]
    raw = LLMEngine.from_pretrained(path, vocab_limit=None)  # nothing masked: the padding wins
    assert all(t >= real for out in raw.generate(prompts, SamplingParams(max_tokens=4)) for t in out)
    engine = LLMEngine.from_pretrained(path)
    for params in (
        SamplingParams(max_tokens=16, ignore_eos=True),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=4),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=2.0, top_p=0.9, seed=5),
    ):
        outs = engine.generate(prompts, params)
        assert all(len(out) == 16 and all(0 <= t < real for t in out) for out in outs), outs
    # what it emitted goes back in as a prompt (a later turn of the same conversation)
    again = engine.generate([prompts[0] + outs[0]], SamplingParams(max_tokens=4))[0]
    assert all(0 <= t < real for t in again)


def test_a_decode_instances_local_prefill_and_steps_emit_only_decodable_ids(padded):
    """The decode server's own samplers: the step driver's (a locally prefilled first token) and
    rank 0's (every later token); the prefill server's are checked through the router
    (tests/router/test_admission_rules.py)."""
    path, real = padded
    worker = DecodeWorkerConfig(str(path), num_slots=128)
    with DecodeInstance(worker, LaunchConfig(1, free_port()), page_size=4) as inst:
        driver = DecodeStepDriver(inst)
        reqs = [
            driver.submit([5, 9, 100], SamplingParams(max_tokens=6, ignore_eos=True, **kw))
            for kw in ({}, {"temperature": 1.0, "seed": 2, "logprobs": 3})
        ]
        driver.run_until_idle()
    for r in reqs:
        assert len(r.output_ids) == 6 and all(0 <= t < real for t in r.output_ids), r.output_ids
        assert all(t < real for lp in r.logprobs for t, _ in lp.top)
