"""Where flashinfer was carried: the flashinfer ops against the torch ops on the GPU, at the
released MLA dims (bf16): attention out within bf16 tolerance, lse within 1e-3, the indexer's
selections identical, and the engine's greedy tokens with each set of ops."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attn_ops import TorchOps, gather_facts, select_attention_ops
from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams

fi = pytest.importorskip("flashinfer")
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def ops(mla):
    from pdserve.engine.attn_flashinfer import FlashinferOps
    from pdserve.model.config import ModelConfig

    cfg = ModelConfig.from_pretrained(mla)
    choice = select_attention_ops("flashinfer", gather_facts(CUDA, torch.bfloat16, cfg))
    return FlashinferOps(CUDA, choice.backend)


@pytest.mark.parametrize("shared", [True, False])
def test_attend_matches_torch(ops, shared):
    g = torch.Generator().manual_seed(0)
    B, H, S = 6, 16, 2500
    q = torch.randn(B, H, 576, generator=g).to(CUDA, torch.bfloat16)
    keys = torch.randn(S, 576, generator=g) if shared else torch.randn(B, S, 576, generator=g)
    keys = keys.to(CUDA, torch.bfloat16)
    valid = (torch.rand(B, S, generator=g) > 0.2).to(CUDA)
    valid[2] = False
    out, lse = ops.attend(q, keys, valid, 576**-0.5, 512)
    ref_out, ref_lse = TorchOps().attend(q, keys, valid, 576**-0.5, 512)
    assert (out.float() - ref_out.float()).abs().max().item() <= 2e-2
    ok = torch.isfinite(ref_lse)
    assert (lse[ok] - ref_lse[ok]).abs().max().item() <= 1e-3
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()


def test_topk_selections_identical(ops):
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(8, 32768, generator=g).to(CUDA)
    scores[:, 100:200] = 0.5  # ties across the k-th place
    valid = torch.ones_like(scores, dtype=torch.bool)
    valid[3, 5000:] = False  # fewer valid keys than k in one row
    assert torch.equal(ops.topk(scores, valid, 2048), TorchOps().topk(scores, valid, 2048))


def test_engine_greedy_with_each_ops(mla):
    prompt = list(range(3, 403))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {}
    for name in ("torch", "flashinfer"):
        e = LLMEngine.from_pretrained(mla, "bfloat16", device="cuda", max_kv_tokens=1024, attention_ops=name)
        assert e.ops.name == name
        runs[name] = e.generate([prompt], params)[0]
    print("greedy tokens:", runs)
    same = next((i for i, (a, b) in enumerate(zip(runs["torch"], runs["flashinfer"])) if a != b), None)
    assert same is None or same >= 2, f"flashinfer and torch ops diverge at step {same}: {runs}"
