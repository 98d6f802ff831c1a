"""docs/design.md invariant 1: the single-rank engine computes what Hugging Face transformers computes.

For each architecture, on checkpoints written by `make-model` and by transformers' save_pretrained:
prefill logits at every position in float64 (max abs <= 1e-8) and float32 (relative <= 1e-4) for
prompt lengths 1, topk-1, topk, topk+1 and 4*topk+3; a 32-token greedy continuation equal to
transformers' generate; and a mixed batch of 3 requests that decodes exactly as each alone.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.conftest import ARCHS

SOURCES = ("make-model", "save_pretrained")
CASES = [(a, s) for a in ARCHS for s in SOURCES]
TOPK = 8  # index_topk of the tiny presets; the dense model gets the same lengths


def reference_model(path, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.config._experts_implementation = "eager"  # the grouped kernel has no float64
    return model.eval()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch,source", CASES)
def test_prefill_logits_match_reference(tiny_checkpoints, arch, source):
    path = tiny_checkpoints[(arch, source)]
    assert LLMEngine.from_pretrained(path).config.index_topk in (TOPK, 0)
    for dtype, name in ((torch.float64, "float64"), (torch.float32, "float32")):
        ref = reference_model(path, dtype)
        engine = LLMEngine.from_pretrained(path, name, max_kv_tokens=256)
        for n in (1, TOPK - 1, TOPK, TOPK + 1, 4 * TOPK + 3):
            ids = prompt(n, seed=n)
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0]
            got = engine.prefill_logits(ids)
            assert got.shape == want.shape
            err = (got - want).abs().max().item()
            if dtype == torch.float64:
                assert err <= 1e-8, (arch, source, n, err)
            else:
                assert err <= 1e-4 * want.abs().max().item(), (arch, source, n, err)
        engine.allocator.check_integrity()
        assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("arch,source", CASES)
def test_greedy_continuation_matches_reference_generate(tiny_checkpoints, arch, source):
    path = tiny_checkpoints[(arch, source)]
    ref = reference_model(path, torch.float64)
    ids = prompt(2 * TOPK + 5, seed=7)
    ref.generation_config.eos_token_id = None  # 32 tokens whatever they are, as ignore_eos does
    with torch.no_grad():
        full = ref.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    want = full[0, len(ids) :].tolist()
    engine = LLMEngine.from_pretrained(path, "float64", max_kv_tokens=256)
    got = engine.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_decodes_like_each_request_alone(tiny_checkpoints, arch):
    path = tiny_checkpoints[(arch, "make-model")]
    prompts = [
        prompt(3, 1),
        prompt(2 * TOPK + 1, 2),
        prompt(5 * TOPK, 3),
    ]  # below, around and far above top-k
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 12, 16)]
    engine = LLMEngine.from_pretrained(path, "float64", max_kv_tokens=512)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    together = engine.generate(prompts, params)
    assert together == alone
    assert [len(t) for t in together] == [20, 12, 16]
    engine.allocator.check_integrity()
    assert engine.allocator.num_free == engine.allocator.num_pages
