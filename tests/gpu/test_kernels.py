"""The torch ops on CUDA equal the CPU float64 reference (engine/attn_ops.TorchOps)."""

from __future__ import annotations

import torch

from pdserve.engine.attn_ops import TorchOps
from pdserve.model.kernels import index_scores

CUDA = torch.device("cuda", 0)


def _case(seed: int, B=5, H=16, S=300, dv=512, rope=64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, dv + rope, generator=g, dtype=torch.float64)
    keys = torch.randn(B, S, dv + rope, generator=g, dtype=torch.float64)
    valid = torch.rand(B, S, generator=g) > 0.3
    valid[1] = False  # a row with no key
    return q, keys, valid


def test_attend_float64_and_float32_on_cuda():
    ops = TorchOps()
    q, keys, valid = _case(0)
    ref_out, ref_lse = ops.attend(q, keys, valid, 0.07, 512)
    out, lse = ops.attend(q.to(CUDA), keys.to(CUDA), valid.to(CUDA), 0.07, 512)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (out.cpu() - ref_out).abs().max() <= 1e-10
    assert (lse.cpu()[finite] - ref_lse[finite]).abs().max() <= 1e-10
    out, lse = ops.attend(q.float().to(CUDA), keys.float().to(CUDA), valid.to(CUDA), 0.07, 512)
    assert (out.double().cpu() - ref_out).abs().max() <= 1e-4
    assert (lse.double().cpu()[finite] - ref_lse[finite]).abs().max() <= 1e-4
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


def test_indexer_topk_and_merge_on_cuda():
    ops = TorchOps()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(4, 8, 128, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(4, 3000, 128, generator=g, dtype=torch.float64)
    valid = torch.rand(4, 3000, generator=g) > 0.1
    ref = index_scores(q, w, k, 128**-0.5)
    got = index_scores(q.to(CUDA), w.to(CUDA), k.to(CUDA), 128**-0.5)
    assert (got.cpu() - ref).abs().max() <= 1e-10
    ref_sel = ops.topk(ref, valid, 2048)
    assert torch.equal(ops.topk(ref.to(CUDA), valid.to(CUDA), 2048).cpu(), ref_sel)
    ties = torch.zeros(2, 50, dtype=torch.float64)  # every score tied: the earliest keys win
    assert (
        ops.topk(ties.to(CUDA), torch.ones(2, 50, dtype=torch.bool, device=CUDA), 8).cpu().tolist()
        == [list(range(8))] * 2
    )
    outs, lses = torch.randn(3, 4, 16, 64, dtype=torch.float64), torch.randn(3, 4, 16, dtype=torch.float64)
    lses[0, 0] = float("-inf")
    a, b = ops.merge(outs, lses)
    c, d = ops.merge(outs.to(CUDA), lses.to(CUDA))
    assert (c.cpu() - a).abs().max() <= 1e-12 and (d.cpu() - b).abs().max() <= 1e-12
