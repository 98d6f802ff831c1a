"""model/fusion.py: after loading, the projections that read one input are one stacked product
(q_a / kv_a / indexer wk; an MLP's gate / up) whose parts are views into the stack (the weights
exist once, under their own names); a forward with the stacks equals one without them (float64,
prefill and decode rows); a part whose storage is replaced is noticed and the module falls back to
its parts until fuse_projections stacks it anew, as tp_shard.shard_mlp does after slicing."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.presets import ARCHS
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.attention import MLAttention
from pdserve.model.fusion import fuse_projections
from pdserve.model.layers import MLP
from pdserve.model.weights import load_model
from pdserve.request import SamplingParams
from pdserve.runtime.tp_shard import shard_mlp


def _unfuse(model) -> None:
    for m in model.modules():
        if isinstance(m, MLAttention):
            m.a_stack = None
        elif isinstance(m, MLP):
            m.gate_up = None


def _storage_bytes(model) -> int:
    """Bytes of every distinct storage behind the parameters and the stacks."""
    stacks = [
        m.a_stack if isinstance(m, MLAttention) else getattr(m, "gate_up", None) for m in model.modules()
    ]
    tensors = list(model.parameters()) + [s.weight for s in stacks if s is not None]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_stacks_are_live_views_and_the_weights_exist_once(tiny_checkpoints, arch):
    model = load_model(tiny_checkpoints[(arch, "make-model")], torch.float64, float32_islands=False)
    attns = [m for m in model.modules() if isinstance(m, MLAttention)]
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.gate_up is not None and m.gate_up.live() for m in mlps)
    for attn in attns:
        parts = attn.input_projections()
        if len(parts) < 2:  # deepseek_v3 tiny: no q LoRA, no indexer: kv_a alone, nothing to stack
            assert attn.a_stack is None
            continue
        stack = attn.a_stack
        assert stack is not None and stack.live() and stack.parts == parts
        assert stack.weight.shape == (sum(p.weight.shape[0] for p in parts), model.config.hidden_size)
        start = 0
        for p in parts:  # each part is its rows of the stack, the same storage
            assert p.weight.untyped_storage().data_ptr() == stack.weight.untyped_storage().data_ptr()
            assert torch.equal(stack.weight[start : start + p.weight.shape[0]], p.weight)
            start += p.weight.shape[0]
    if arch != "deepseek_v3":
        assert any(a.a_stack is not None for a in attns)
    # the stacks add no bytes: the storages behind parameters and stacks hold the parameters once
    assert _storage_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_stacked_forward_equals_the_parts_in_float64(tiny_checkpoints, arch):
    path = tiny_checkpoints[(arch, "save_pretrained")]
    fused = load_model(path, torch.float64, float32_islands=False)
    plain = load_model(path, torch.float64, float32_islands=False)
    _unfuse(plain)
    engines = [LLMEngine(m, max_kv_tokens=256, page_size=16, attention_ops="torch") for m in (fused, plain)]
    prompt = [5, 9, 3, 17, 2, 40, 11, 8, 30, 7, 12]
    for ids in (prompt, [7]):  # many rows (prefill), one row (a decode step's products)
        a, b = (e.prefill_logits(ids) for e in engines)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b = (e.generate([prompt, [4, 4, 19]], params) for e in engines)  # decode batches of 2
    assert a == b


def test_a_replaced_part_falls_back_until_stacked_again(tiny_checkpoints):
    model = load_model(tiny_checkpoints[("glm_moe_dsa", "make-model")], torch.float64, float32_islands=False)
    attn = next(m for m in model.modules() if isinstance(m, MLAttention) and m.indexer is not None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.float64, generator=g)
    wk = attn.indexer.wk
    wk.weight.data = (wk.weight * 2).contiguous()  # a new storage: the stack would still read the old rows
    assert not attn.a_stack.live()
    q_a, kv_a, wk_x = attn._project_input(x)
    assert wk_x is None  # the indexer computes wk itself, from the new weight
    torch.testing.assert_close(kv_a, x @ attn.kv_a_proj_with_mqa.weight.t(), rtol=1e-13, atol=1e-13)
    fuse_projections(model)
    assert attn.a_stack.live()
    _, _, wk_x = attn._project_input(x)
    torch.testing.assert_close(wk_x, x @ wk.weight.t(), rtol=1e-13, atol=1e-13)


def test_shard_mlp_stacks_the_slices_anew():
    torch.manual_seed(0)
    mlp = MLP(8, 6).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64))
    full = (mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone(), mlp.down_proj.weight.clone())
    fuse_projections(mlp)
    x = torch.randn(4, 8, dtype=torch.float64)
    parts = []
    for rank in range(2):
        shard = MLP(8, 6).double()
        with torch.no_grad():
            for p, w in zip((shard.gate_proj, shard.up_proj, shard.down_proj), full):
                p.weight.copy_(w)
        fuse_projections(shard)
        shard_mlp(shard, rank, 2)
        assert shard.gate_up is not None and shard.gate_up.live()
        assert shard.gate_up.weight.shape == (6, 8)  # 3 gate rows and 3 up rows of this rank
        parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1], mlp(x), rtol=1e-12, atol=1e-12)
