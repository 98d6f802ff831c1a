"""The attention math on its own: top-k tie rule, exact LSE merge, attend against a naive softmax."""

import math

import torch

from pdserve.model.kernels import attend, index_scores, merge_attention, topk_earliest


def naive_topk_earliest(scores, valid, k):
    out = []
    for row, v in zip(scores.tolist(), valid.tolist()):
        cand = [(-s, j) for j, (s, ok) in enumerate(zip(row, v)) if ok]
        chosen = sorted(j for _, j in sorted(cand)[:k])
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out)


def test_topk_ties_prefer_the_earlier_token():
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0]])
    valid = torch.ones_like(scores, dtype=torch.bool)
    # two places left after 2.0 and 1.0: the earliest zeros are tokens 0 and 2
    assert topk_earliest(scores, valid, 4).tolist() == [[0, 1, 2, 4]]


def test_topk_matches_naive_rule_on_many_ties():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        B, S, k = (
            6,
            int(torch.randint(1, 70, (1,), generator=g)),
            int(torch.randint(1, 20, (1,), generator=g)),
        )
        scores = torch.randint(-2, 3, (B, S), generator=g).float().relu()  # many exact zeros, ties everywhere
        valid = torch.rand(B, S, generator=g) < 0.8
        assert torch.equal(topk_earliest(scores, valid, k), naive_topk_earliest(scores, valid, k)), trial


def test_topk_without_ties_and_with_a_tie_at_the_kth_place():
    """Distinct scores take topk's own set (sorted); a tie across the k-th place, an invalid key
    among the top scores or fewer valid keys than k take the tie rule's path: both equal the rule."""
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        B, S, k = (
            3,
            int(torch.randint(5, 600, (1,), generator=g)),
            int(torch.randint(1, 300, (1,), generator=g)),
        )
        scores = torch.randn(B, S, generator=g, dtype=torch.float64)  # no ties
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[1, : S // 2] = False  # some invalid keys, maybe fewer than k valid ones
        if k < S:
            scores[2, : k + 1] = scores[2].max() + 1  # k + 1 keys tie for the top: the earliest k win
        assert torch.equal(topk_earliest(scores, valid, k), naive_topk_earliest(scores, valid, k)), trial


def test_topk_rows_with_few_valid_keys_pad_with_minus_one():
    scores = torch.tensor([[5.0, 4.0, 3.0]])
    valid = torch.tensor([[True, False, True]])
    assert topk_earliest(scores, valid, 4).tolist() == [[0, 2, -1, -1]]


def naive_attention(q, keys, valid, scale, dv):
    s = torch.einsum("bhd,bsd->bhs", q, keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsd->bhd", torch.softmax(s, -1), keys[..., :dv])


def test_attend_matches_softmax_and_returns_lse():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 10, generator=g, dtype=torch.float64)
    keys = torch.randn(3, 7, 10, generator=g, dtype=torch.float64)
    valid = torch.rand(3, 7, generator=g) < 0.7
    valid[:, 0] = True
    out, lse = attend(q, keys, valid, 0.3, 6)
    assert torch.allclose(out, naive_attention(q, keys, valid, 0.3, 6), atol=1e-12)
    s = (torch.einsum("bhd,bsd->bhs", q, keys) * 0.3).masked_fill(~valid[:, None], float("-inf"))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-12)
    shared_out, _ = attend(q, keys[0], valid, 0.3, 6)  # keys shared by all queries
    assert torch.allclose(shared_out, naive_attention(q, keys[0].expand(3, 7, 10), valid, 0.3, 6), atol=1e-12)


def test_merge_of_disjoint_parts_is_exact_and_empty_parts_contribute_zero():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 8, generator=g, dtype=torch.float64)
    keys = torch.randn(2, 12, 8, generator=g, dtype=torch.float64)
    full, full_lse = attend(q, keys, torch.ones(2, 12, dtype=torch.bool), 0.5, 5)
    owner = torch.arange(12) % 4  # slot s lives on rank s % 4; rank 3 also gets an empty part below
    parts = [attend(q, keys, (owner == r).expand(2, 12), 0.5, 5) for r in range(4)]
    parts.append(
        attend(q, keys, torch.zeros(2, 12, dtype=torch.bool), 0.5, 5)
    )  # a rank that selected nothing
    assert torch.isinf(parts[-1][1]).all() and (parts[-1][0] == 0).all()
    out, lse = merge_attention(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert (out - full).abs().max() < 1e-13
    assert (lse - full_lse).abs().max() < 1e-13
    none, none_lse = merge_attention(torch.zeros(2, 1, 5), torch.full((2, 1), float("-inf")))
    assert not torch.isnan(none).any() and (none == 0).all() and torch.isinf(none_lse).all()


def test_index_scores_weight_relu_per_head():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [B=1, Hi=2, Di=2]
    w = torch.tensor([[2.0, -1.0]])
    keys = torch.tensor([[1.0, 1.0], [-1.0, 3.0], [-1.0, -1.0]])
    # head scores: k0 -> (1, 1), k1 -> (relu(-1)=0, 3), k2 -> (0, 0)
    assert index_scores(q, w, keys, 1.0).tolist() == [[2.0 - 1.0, -3.0, 0.0]]


def test_merge_of_one_part_is_that_part():
    out = torch.randn(3, 4, 5, dtype=torch.float64)
    lse = torch.randn(3, 4, dtype=torch.float64)
    merged, merged_lse = merge_attention(out[None], lse[None])
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)


def test_merge_with_equal_lses_is_the_mean():
    outs = torch.randn(4, 2, 3, dtype=torch.float64)
    lses = torch.full((4, 2), 1.5, dtype=torch.float64)
    merged, lse = merge_attention(outs, lses)
    assert torch.allclose(merged, outs.mean(0), atol=1e-15)
    assert torch.allclose(lse, torch.full((2,), 1.5 + math.log(4.0), dtype=torch.float64), atol=1e-15)


def test_merge_with_one_dominant_part_returns_it():
    outs = torch.randn(3, 2, 6, dtype=torch.float64)
    lses = torch.tensor([[0.0, 0.0], [800.0, 800.0], [1.0, 1.0]], dtype=torch.float64)  # exp(-800) underflows
    merged, lse = merge_attention(outs, lses)
    assert torch.equal(merged, outs[1]) and torch.equal(lse, lses[1])


def test_merge_ignores_a_minus_inf_part_even_if_it_holds_nan():
    outs = torch.randn(3, 2, 4, dtype=torch.float64)
    lses = torch.randn(3, 2, dtype=torch.float64)
    outs[2] = float("nan")
    lses[2] = float("-inf")
    merged, _ = merge_attention(outs, lses)
    want, _ = merge_attention(outs[:2], lses[:2])
    assert not torch.isnan(merged).any() and torch.equal(merged, want)
