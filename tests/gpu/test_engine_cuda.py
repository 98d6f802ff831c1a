"""A tiny model on CUDA: float64 logits within 1e-8 of the CPU; bf16 greedy tokens equal to the
float64 reference for 16 steps, or the first divergence explained by a near tie."""

from __future__ import annotations

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams

PROMPT = list(range(7, 90))  # longer than the tiny model's top-k: the indexer selects
STEPS = 16


def test_float64_on_cuda_equals_cpu(tiny):
    cpu = LLMEngine.from_pretrained(tiny, "float64", float32_islands=False, max_kv_tokens=512)
    gpu = LLMEngine.from_pretrained(tiny, "float64", float32_islands=False, device="cuda", max_kv_tokens=512)
    a, b = cpu.prefill_logits(PROMPT), gpu.prefill_logits(PROMPT)
    assert b.device.type == "cuda"
    assert (b.cpu() - a).abs().max().item() <= 1e-8
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    assert gpu.generate([PROMPT], params) == cpu.generate([PROMPT], params)


def test_bfloat16_greedy_on_cuda(tiny):
    ref = LLMEngine.from_pretrained(tiny, "float64", float32_islands=False, max_kv_tokens=512)
    gpu = LLMEngine.from_pretrained(tiny, "bfloat16", device="cuda", max_kv_tokens=512, attention_ops="torch")
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    want, got = ref.generate([PROMPT], params)[0], gpu.generate([PROMPT], params)[0]
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = ref.prefill_logits(PROMPT + want[:i])[-1]  # the reference's logits at the divergence
    gap = (logits[want[i]] - logits[got[i]]).item()
    scale = logits.abs().max().item()
    # bf16 keeps 8 bits of mantissa: a choice within 2^-6 of the logits' scale is a tie at bf16
    assert 0 <= gap <= scale * 2**-6, f"step {i}: bf16 chose {got[i]}, reference {want[i]}, gap {gap:.4g}"
