"""The native decode-step ops of native/ops.py beside the few-row products: attention over
gathered keys (native/attend.c), the DSA indexer's scores and top-k, RMSNorm, the MoE router and
routed experts of a step's few tokens (native/moe.c). Each agrees with a float64 reference (top-k and routing: with
torch's own rule, exactly), does not depend on the thread count, and is taken only by a decode
step's float32 CPU tensors: float64, more rows (a prefill's queries over shared keys, or a batch
beyond MAX_BATCH) or odd layouts keep torch's ops."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.presets import hf_config
from pdserve.model import kernels
from pdserve.model.config import ModelConfig
from pdserve.model.layers import Experts, RMSNorm, TopkRouter
from pdserve.native import ops as native

pytestmark = pytest.mark.skipif(
    native.status().startswith("unavailable"), reason=f"the native kernel is {native.status()}"
)
OPS = ["attend_usable", "index_scores_usable", "topk_usable", "rms_norm_usable", "route_usable", "moe_usable"]


@pytest.fixture
def torch_ops(monkeypatch):
    """A context in which every op here takes torch's path (the reference for exact comparisons)."""

    class Off:
        def __enter__(self):
            for name in OPS:
                monkeypatch.setattr(native, name, lambda *a: False)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Off()


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    assert (y.double() - ref).abs().max().item() <= tol * scale


# B, H, S, D, dv, shared keys: one unit (S <= 256), several (up to 16), heads and widths off the vector
@pytest.mark.parametrize(
    "B,H,S,D,dv,shared",
    [
        (1, 16, 512, 576, 512, False),
        (8, 16, 300, 576, 512, False),
        (32, 16, 300, 64, 48, False),
        (2, 16, 1000, 576, 512, True),
        (3, 5, 37, 70, 33, False),
        (1, 13, 5000, 24, 17, True),
        (2, 1, 1, 8, 8, False),
    ],
)
def test_attend_matches_float64(B, H, S, D, dv, shared):
    g = torch.Generator().manual_seed(B * 100 + S)
    q = torch.randn(B, H, D + 3, generator=g)[:, :, 2 : D + 2]  # strided heads
    keys = torch.randn(*((S,) if shared else (B, S)), D + 1, generator=g)[..., :D]  # rows D + 1 apart
    valid = torch.rand(B, S, generator=g) > 0.3
    valid[0, 0] = True
    if B > 1:
        valid[-1] = False  # a query that sees no key: out 0, lse -inf
    assert native.attend_usable(q, keys, valid, dv)
    out, lse = kernels.attend(q, keys, valid, 0.07, dv)
    ref_out, ref_lse = kernels.attend(q.double(), keys.double(), valid, 0.07, dv)
    _close(out, ref_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    live = ~torch.isinf(ref_lse)
    assert (lse[live].double() - ref_lse[live]).abs().max().item() <= 1e-5 * max(
        1.0, ref_lse[live].abs().max().item()
    )
    if B > 1:
        assert (out[-1] == 0).all() and (lse[-1] == float("-inf")).all()


@pytest.mark.parametrize("B,H,S,D,dv", [(25, 8, 256, 160, 128), (1, 16, 512, 576, 512), (3, 5, 37, 70, 33)])
def test_attend_over_table_rows_matches_float64(B, H, S, D, dv):
    """A sparse layer's selection read where it lies in the cache: the same as gathering it first."""
    g = torch.Generator().manual_seed(B + S)
    table = torch.randn(3000, D + 2, generator=g)[:, :D]  # rows of a wider tensor
    q = torch.randn(B, H, D, generator=g)
    rows = torch.randint(0, 3000, (B, S), generator=g)
    rows[0, S // 2 :] = -1  # fewer keys than S
    if B > 1:
        rows[1] = -1  # none: out 0, lse -inf
    assert native.attend_rows_usable(q, table, rows, dv)
    out, lse = kernels.attend_rows(q, table, rows, 0.1, dv)
    ref_out, ref_lse = kernels.attend(q.double(), table.double()[rows.clamp(min=0)], rows >= 0, 0.1, dv)
    _close(out, ref_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    live = ~torch.isinf(ref_lse)
    assert (lse[live].double() - ref_lse[live]).abs().max().item() <= 1e-5 * ref_lse[live].abs().max().item()


def test_attend_over_table_rows_refuses_a_row_outside_the_table():
    q, table = torch.randn(2, 4, 16), torch.randn(10, 16)
    rows = torch.tensor([[0, 3, -1], [9, 10, 2]])
    with pytest.raises(IndexError, match="outside its table"):
        kernels.attend_rows(q, table, rows, 0.1, 8)
    rows[1, 1] = -1  # no key there: nothing is read, nothing refused
    kernels.attend_rows(q, table, rows, 0.1, 8)


def test_index_scores_match_float64():
    g = torch.Generator().manual_seed(3)
    for B, H, S, D, shared in [(1, 16, 1024, 128, False), (3, 5, 77, 20, True), (8, 9, 300, 64, False)]:
        q, w = torch.randn(B, H, D, generator=g), torch.randn(B, H, generator=g)
        keys = torch.randn(S, D, generator=g) if shared else torch.randn(B, S, D, generator=g)
        assert native.index_scores_usable(q, w, keys)
        ref = kernels.index_scores(q.double(), w.double(), keys.double(), 0.088)
        _close(kernels.index_scores(q, w, keys, 0.088), ref)


def test_topk_equals_torchs_rule(torch_ops):
    """Ties (small integer scores), -inf scores, fewer valid keys than k, k beyond S: the same
    indices as kernels.topk_earliest's torch path, the tie rule of docs/design.md invariant 3."""
    g = torch.Generator().manual_seed(4)
    cases = 0
    for trial in range(300):
        B, S = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 400, (1,), generator=g))
        k = int(torch.randint(1, S + 30, (1,), generator=g))
        s = torch.randint(-3, 4, (B, S), generator=g).float() if trial % 2 else torch.randn(B, S, generator=g)
        if trial % 5 == 0:
            s[0, ::3] = float("-inf")
        valid = torch.rand(B, S, generator=g) > 0.2
        assert native.topk_usable(s, valid, k)
        got = kernels.topk_earliest(s, valid, k)
        with torch_ops:
            want = kernels.topk_earliest(s, valid, k)
        assert torch.equal(got, want), (B, S, k)
        cases += 1
    assert cases == 300


def test_topk_with_a_nan_score_keeps_torchs_rule(torch_ops):
    s, valid = torch.randn(2, 50), torch.ones(2, 50, dtype=torch.bool)
    s[0, 3] = float("nan")
    assert native.topk_earliest(s, valid, 10) is None  # the kernel declines ...
    got = kernels.topk_earliest(s, valid, 10)
    with torch_ops:
        assert torch.equal(got, kernels.topk_earliest(s, valid, 10))  # ... and torch decides


def test_rms_norm_matches_float64():
    g = torch.Generator().manual_seed(5)
    for M, N, size in [(1, 2048, 3.0), (3, 37, 3.0), (8, 512, 3.0), (1, 1, 3.0), (2, 64, 1e-3)]:
        norm = RMSNorm(N)
        norm.weight = torch.nn.Parameter(torch.randn(N, generator=g), requires_grad=False)
        x = torch.randn(M, N + 5, generator=g)[:, :N] * size  # rows of a wider tensor; 1e-3: eps matters
        assert native.rms_norm_usable(x, norm.weight)
        _close(norm(x), torch.rms_norm(x.double(), (N,), norm.weight.double(), 1e-6))


def _medium_config() -> ModelConfig:
    return ModelConfig.from_dict(hf_config("glm_moe_dsa", "medium"))


def _router(cfg: ModelConfig, g: torch.Generator) -> TopkRouter:
    r = TopkRouter(cfg)
    r.weight = torch.nn.Parameter(torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g) * 0.02)
    r.e_score_correction_bias = torch.nn.Parameter(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    return r.requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 3, native.MAX_ROWS])
def test_router_chooses_torchs_experts(torch_ops, rows):
    cfg, g = _medium_config(), torch.Generator().manual_seed(6 + rows)
    for _ in range(100 // rows):
        router, x = _router(cfg, g), torch.randn(rows, cfg.hidden_size, generator=g)
        weights, ids = router(x)
        assert native.route_usable(
            x,
            router.weight,
            router.e_score_correction_bias,
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
        )
        with torch_ops:
            ref_w, ref_ids = router(x)
        order = ref_ids.argsort(dim=-1)
        assert torch.equal(ids, ref_ids.gather(1, order))  # each row's ids ascending
        _close(weights, ref_w.gather(1, order).double(), 1e-6)


def test_router_ties_go_to_the_earlier_expert():
    cfg = _medium_config()
    router = TopkRouter(cfg).requires_grad_(False)
    router.weight = torch.nn.Parameter(
        torch.zeros(cfg.n_routed_experts, cfg.hidden_size), requires_grad=False
    )
    router.e_score_correction_bias = torch.nn.Parameter(
        torch.zeros(cfg.n_routed_experts), requires_grad=False
    )
    weights, ids = router(torch.randn(1, cfg.hidden_size))  # every score equal
    per = cfg.n_routed_experts // cfg.n_group
    assert ids[0].tolist() == list(range(cfg.num_experts_per_tok))  # groups 0 and 1, their first experts
    assert cfg.num_experts_per_tok <= cfg.topk_group * per
    torch.testing.assert_close(
        weights, torch.full_like(weights, cfg.routed_scaling_factor / cfg.num_experts_per_tok)
    )


def _experts(E: int, H: int, I: int, g: torch.Generator, dtype=torch.float32) -> Experts:
    ex = Experts(E, H, I)
    ex.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, generator=g, dtype=dtype) / H**0.5)
    ex.down_proj = torch.nn.Parameter(torch.randn(E, H, I, generator=g, dtype=dtype) / I**0.5)
    return ex.requires_grad_(False)


def _float64(ex: Experts) -> Experts:
    ref = Experts(*ex.down_proj.shape[:2], ex.down_proj.shape[2])
    ref.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.double(), requires_grad=False)
    ref.down_proj = torch.nn.Parameter(ex.down_proj.double(), requires_grad=False)
    return ref


@pytest.mark.parametrize("E,H,I,k", [(16, 2048, 1024, 4), (5, 37, 19, 3), (4, 8, 1, 2)])
def test_one_token_experts_match_float64(E, H, I, k):
    g = torch.Generator().manual_seed(E + H)
    ex = _experts(E, H, I, g)
    x = torch.randn(1, H, generator=g)
    ids, w = torch.randperm(E, generator=g)[:k].view(1, k), torch.rand(1, k, generator=g)
    assert native.moe_usable(x, ex.gate_up_proj, ex.down_proj)
    _close(ex(x, w, ids), _float64(ex)(x.double(), w.double(), ids))


# rows, E, H, I, k: every row count of a step, odd widths, every expert chosen (E = 4, k = 4 x 8 rows:
# groups of MAX_ROWS rows), a single expert
@pytest.mark.parametrize(
    "rows,E,H,I,k",
    [
        (2, 16, 512, 256, 4),
        (5, 16, 512, 256, 4),
        (8, 16, 512, 256, 4),
        (3, 5, 37, 19, 3),
        (8, 4, 24, 13, 4),
        (7, 1, 16, 8, 1),
    ],
)
def test_few_rows_experts_match_float64(rows, E, H, I, k):
    g = torch.Generator().manual_seed(rows * 10 + E)
    ex = _experts(E, H, I, g)
    x = torch.randn(rows, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])  # distinct, unsorted
    w = torch.rand(rows, k, generator=g)
    assert native.moe_usable(x, ex.gate_up_proj, ex.down_proj)
    _close(ex(x, w, ids), _float64(ex)(x.double(), w.double(), ids))


def test_few_rows_experts_count_an_expert_a_row_chose_twice():
    """Routing never repeats an expert in a row; the kernel still sums each choice, as torch's path does."""
    g = torch.Generator().manual_seed(11)
    ex, x = _experts(6, 40, 24, g), torch.randn(3, 40, generator=g)
    ids, w = torch.tensor([[2, 2, 5], [0, 2, 2], [5, 5, 5]]), torch.rand(3, 3, generator=g)
    _close(ex(x, w, ids), _float64(ex)(x.double(), w.double(), ids))


def test_experts_refuse_an_expert_outside_the_table():
    ex = _experts(4, 16, 8, torch.Generator().manual_seed(7))
    with pytest.raises(IndexError, match="outside"):
        ex(torch.randn(1, 16), torch.rand(1, 2), torch.tensor([[1, 4]]))
    with pytest.raises(IndexError, match="outside"):
        ex(torch.randn(3, 16), torch.rand(3, 2), torch.tensor([[1, 2], [0, 3], [-1, 2]]))


def test_results_do_not_depend_on_the_thread_count(assert_thread_count_free):
    g = torch.Generator().manual_seed(8)
    q, keys = torch.randn(2, 16, 576, generator=g), torch.randn(2, 2000, 576, generator=g)
    valid = torch.rand(2, 2000, generator=g) > 0.1
    iq, iw, ik = (
        torch.randn(1, 16, 128, generator=g),
        torch.randn(1, 16, generator=g),
        torch.randn(1, 4096, 128),
    )
    ex, x = _experts(8, 512, 256, g), torch.randn(1, 512, generator=g)
    ids, w = torch.tensor([[1, 3, 6]]), torch.rand(1, 3, generator=g)
    xs, rows_ids, rows_w = (
        torch.randn(5, 512, generator=g),
        torch.randint(0, 8, (5, 3), generator=g),
        torch.rand(5, 3),
    )
    cfg = _medium_config()
    router, rx = _router(cfg, g), torch.randn(1, cfg.hidden_size, generator=g)
    rxs = torch.randn(6, cfg.hidden_size, generator=g)
    scores = torch.randn(4, 70000, generator=g)
    valid_all = torch.ones_like(scores, dtype=torch.bool)
    assert_thread_count_free(
        lambda: (
            *kernels.attend(q, keys, valid, 0.05, 512),
            kernels.index_scores(iq, iw, ik, 0.1),
            ex(x, w, ids),
            ex(xs, rows_w, rows_ids),
            *router(rx),
            *router(rxs),
            kernels.topk_earliest(scores, valid_all, 2048),
        )
    )


def test_only_a_decode_steps_float32_cpu_tensors_take_them(native_calls):
    calls = native_calls
    g = torch.Generator().manual_seed(9)
    q, keys, valid = (
        torch.randn(1, 4, 16, generator=g),
        torch.randn(1, 9, 16, generator=g),
        torch.ones(1, 9).bool(),
    )
    kernels.attend(q, keys, valid, 0.1, 8)
    kernels.index_scores(q, torch.randn(1, 4, generator=g), keys, 0.1)
    norm = RMSNorm(16).requires_grad_(False)
    norm(torch.randn(1, 16, generator=g))
    assert calls == ["pd_attend", "pd_index_scores", "pd_rms_norm"]
    calls.clear()
    kernels.attend(q.double(), keys.double(), valid, 0.1, 8)  # float64: torch's exact ops
    rows = native.MAX_ROWS + 1  # more queries than a decode step's (prefill): torch's matmuls
    kernels.attend(torch.randn(rows, 4, 16), torch.randn(9, 16), torch.ones(rows, 9).bool(), 0.1, 8)
    kernels.index_scores(torch.randn(rows, 4, 16), torch.randn(rows, 4), torch.randn(9, 16), 0.1)
    batch = native.MAX_BATCH + 1  # keys per query: a decode batch up to MAX_BATCH
    kernels.attend(torch.randn(batch, 4, 16), torch.randn(batch, 9, 16), torch.ones(batch, 9).bool(), 0.1, 8)
    norm(torch.randn(rows, 16))
    norm.double()(torch.randn(1, 16, dtype=torch.float64))
    ex = _experts(4, 16, 8, g, torch.float64)
    ex(torch.randn(1, 16, dtype=torch.float64), torch.rand(1, 2), torch.tensor([[0, 2]]))
    assert calls == []
    # more rows than a step's: torch's grouped experts (whose per-expert products may be few-row ones)
    _experts(4, 16, 8, g)(
        torch.randn(rows, 16), torch.rand(rows, 2), torch.randint(0, 4, (rows, 2), generator=g)
    )
    cfg = _medium_config()
    _router(cfg, g)(torch.randn(rows, cfg.hidden_size))
    assert calls and not {"pd_moe_rows", "pd_route_rows"} & set(calls)
