"""MoE.fold_shared_expert: the shared expert stacked onto the routed ones (taken by every token with
weight 1) gives the layer's output unchanged, bf16-free in float64, with fp8 block scales, and with
expert parallelism (a router id just past this rank's experts is another rank's, not the shared one)."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.presets import hf_config
from pdserve.engine.gemm_ops import set_gemm_ops
from pdserve.model.config import ModelConfig
from pdserve.model.layers import Experts, MoE
from pdserve.model.quant import quantize_fp8


def moe(seed: int, fp8: bool, ep: bool = False, whole_blocks: bool = True) -> tuple[MoE, ModelConfig]:
    d = hf_config("glm_moe_dsa", "tiny")
    if fp8 and whole_blocks:  # 128 x 128 blocks: gate's and up's scales stack into the experts' layout
        d.update(hidden_size=256, moe_intermediate_size=128)
    cfg = ModelConfig.from_dict(d)
    torch.manual_seed(seed)
    m = MoE(cfg)
    if ep:  # this rank: experts 2 .. 2 + E/2 - 1
        m.experts = Experts(cfg.n_routed_experts // 2, cfg.hidden_size, cfg.moe_intermediate_size)
        m.experts.first_expert = 2
    for p in m.parameters():
        p.data = torch.randn(p.shape, dtype=torch.float64) * p.shape[-1] ** -0.5
    m.gate.weight.data = m.gate.weight.data.float()  # the router stays float32, as loaded
    m.gate.e_score_correction_bias.data = m.gate.e_score_correction_bias.data.float()
    if fp8:
        ex = m.experts
        for name in ("gate_up_proj", "down_proj"):
            q, s = quantize_fp8(getattr(ex, name).data, (128, 128))
            setattr(ex, name, torch.nn.Parameter(q, requires_grad=False))
            setattr(ex, name.replace("proj", "scale_inv"), s)
        for lin in (m.shared_experts.gate_proj, m.shared_experts.up_proj, m.shared_experts.down_proj):
            q, s = quantize_fp8(lin.weight.data, (128, 128))
            lin.weight, lin.weight_scale_inv = torch.nn.Parameter(q, requires_grad=False), s
    return m, cfg


@pytest.mark.parametrize("fp8, ep", [(False, False), (True, False), (False, True), (True, True)])
def test_folded_shared_expert_gives_the_same_output(fp8, ep):
    """Two groups of experts (tiny preset): the grouped router too."""
    m, cfg = moe(3, fp8, ep)
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    before = m(x)
    assert m.fold_shared_expert() and m.shared_experts is None
    assert m.experts.gate_up_proj.shape[0] == m.experts.n_routed + 1 == m.experts.shared_slot + 1
    assert not m.fold_shared_expert()  # once
    assert torch.allclose(m(x), before, rtol=1e-12, atol=1e-12)


def test_partial_scale_blocks_are_not_folded():
    """fp8 with I = 32: gate's and up's scale rows would not stack into the experts' [ceil(2I/128)]."""
    m, cfg = moe(6, True, whole_blocks=False)
    assert cfg.moe_intermediate_size % 128
    assert not m.fold_shared_expert() and m.shared_experts is not None


def test_ep_ids_past_this_rank_are_not_the_shared_expert():
    m, _ = moe(4, False, ep=True)
    m.fold_shared_expert()
    ids = torch.tensor([[2, 2 + m.experts.n_routed, 1]])  # ours, the next rank's first, an earlier rank's
    assert m.experts.local_ids(ids).tolist() == [[0, -1, -1]]
    weights, with_shared = m.experts.with_shared(torch.ones(1, 3), m.experts.local_ids(ids))
    assert with_shared.tolist() == [[0, -1, -1, m.experts.shared_slot]] and weights[0, 3] == 1


def test_set_gemm_ops_folds_only_for_the_triton_moe():
    m, _ = moe(5, False)
    set_gemm_ops(m, "torch", "torch")
    assert m.shared_experts is not None and m.experts.ops == "torch"
    set_gemm_ops(m, "triton", "triton")
    assert m.shared_experts is None and m.experts.ops == "triton"
