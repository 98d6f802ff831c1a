"""The kernel layer (engine/attn_ops.py): the selection table, and the flashinfer adapter's calls
checked on CPU against a fake flashinfer module that encodes the signatures of the pinned
flashinfer-python (BatchMLAPagedAttentionWrapper(workspace, backend=...), plan(metadata=
MLAPlanMetadata.csr(...), ...), run(query=, kv_cache=, return_lse=True) with base-2 LSE, top_k(...,
deterministic=, tie_break=)) and computes what the real kernels compute, in float64."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pdserve.checkpoints.presets import hf_config
from pdserve.engine.attn_flashinfer import FlashinferOps
from pdserve.engine.attn_ops import (
    FLASHINFER_VERSION,
    OpsFacts,
    TorchOps,
    cached_index_scores,
    select_attention_ops,
)
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.backend import IndexerInputs
from pdserve.model.config import ModelConfig
from pdserve.model.kernels import index_scores
from pdserve.runtime.device import DevicePlan, check_devices
from pdserve.runtime.placement import parse_gpu_ids

H100, A100, T4 = (9, 0), (8, 0), (7, 5)
GOOD = dict(
    device="cuda",
    capability=H100,
    flashinfer=FLASHINFER_VERSION,
    dtype="bfloat16",
    kv_lora_rank=512,
    rope_dim=64,
    triton="3.6.0",
)
L40 = (8, 9)

# (requested, facts that differ from GOOD, expected ops, fa backend, error/reason fragment)
TABLE = [
    ("auto", {}, "flashinfer", "fa3", "fa3"),
    ("flashinfer", {}, "flashinfer", "fa3", "fa3"),
    ("auto", {"capability": A100}, "flashinfer", "fa2", "fa2"),
    ("torch", {}, "torch", None, "--attention-ops torch"),
    ("auto", {"device": "cpu", "capability": None}, "torch", None, "needs --device cuda"),
    ("flashinfer", {"device": "cpu", "capability": None}, None, None, "needs --device cuda"),
    ("auto", {"flashinfer": None}, "torch", None, "not installed"),
    ("flashinfer", {"flashinfer": None}, None, None, "not installed"),
    ("flashinfer", {"flashinfer": "0.6.1"}, None, None, "0.6.1 is installed"),
    ("auto", {"capability": T4}, "torch", None, "capability 8.0"),
    ("auto", {"dtype": "float32"}, "torch", None, "not float32"),
    ("flashinfer", {"dtype": "float64"}, None, None, "not float64"),
    ("auto", {"kv_lora_rank": 32, "rope_dim": 16}, "torch", None, "has 32 and 16"),
    ("flashinfer", {"kv_lora_rank": 32, "rope_dim": 16}, None, None, "kv_lora_rank 512"),
    # an fp8 cache on cuda: triton (flashinfer does not take it), never the float32 torch ops
    ("auto", {"kv_cache_dtype": "fp8_e4m3"}, "triton", None, "fp8 KV cache, triton 3.6.0"),
    ("auto", {"kv_cache_dtype": "fp8_e4m3", "flashinfer": None}, "triton", None, "not installed"),
    ("auto", {"kv_cache_dtype": "fp8_e4m3", "capability": L40}, "triton", None, "triton 3.6.0"),
    ("auto", {"kv_cache_dtype": "fp8_e4m3", "capability": A100}, None, None, "capability 8.9"),
    ("auto", {"kv_cache_dtype": "fp8_e4m3", "triton": None}, None, None, "triton is not installed"),
    ("auto", {"kv_cache_dtype": "fp8_e4m3", "dtype": "float64"}, None, None, "not float64"),
    ("torch", {"kv_cache_dtype": "fp8_e4m3"}, "torch", None, "--attention-ops torch"),
    ("auto", {"kv_cache_dtype": "fp8_e4m3", "device": "cpu", "capability": None}, "torch", None, "cuda"),
    ("auto", {"flashinfer": None, "triton": None}, "torch", None, "not installed"),  # bf16: torch
    ("triton", {}, "triton", None, "--attention-ops triton"),
    ("triton", {"kv_cache_dtype": "fp8_e4m3", "capability": L40}, "triton", None, "triton 3.6.0"),
    ("triton", {"device": "cpu", "capability": None}, None, None, "triton needs --device cuda"),
    ("triton", {"triton": None}, None, None, "triton is not installed"),
    ("triton", {"capability": T4}, None, None, "capability 8.0"),
    ("triton", {"kv_cache_dtype": "fp8_e4m3", "capability": A100}, None, None, "capability 8.9"),
    ("triton", {"dtype": "float64"}, None, None, "not float64"),
    ("torch", {"device": "cpu", "capability": None, "dtype": "float64"}, "torch", None, "torch"),
]


@pytest.mark.parametrize("requested,diff,name,backend,why", TABLE)
def test_selection_table(requested, diff, name, backend, why):
    facts = OpsFacts(**{**GOOD, **diff})
    if name is None:
        with pytest.raises(ValueError, match="cannot run") as e:
            select_attention_ops(requested, facts)
        assert why in str(e.value)
        return
    choice = select_attention_ops(requested, facts)
    assert (choice.name, choice.backend) == (name, backend)
    assert why in choice.reason


def test_unknown_ops_name():
    with pytest.raises(ValueError, match="--attention-ops must be one of"):
        select_attention_ops("cutlass", OpsFacts(**GOOD))


# ---- device plans: startup errors instead of silent fallbacks ------------------------------------
@pytest.mark.parametrize(
    "device,world,ids,count,gpus,backend,comm",
    [
        ("cpu", 2, (), 0, (), "gloo", "cpu"),
        ("cuda", 1, (), 1, (0,), "gloo", "host"),
        ("cuda", 2, (), 2, (0, 1), "cpu:gloo,cuda:nccl", "nccl"),
        ("cuda", 2, (0, 0), 1, (0, 0), "gloo", "host"),
        ("cuda", 2, (3, 1), 4, (3, 1), "cpu:gloo,cuda:nccl", "nccl"),
    ],
)
def test_device_plans(device, world, ids, count, gpus, backend, comm):
    plan = check_devices(device, world, ids, cuda_count=count)
    assert plan == DevicePlan(device, gpus)
    assert (plan.dist_backend, plan.comm) == (backend, comm)


@pytest.mark.parametrize(
    "device,world,ids,count,msg",
    [
        ("cuda", 1, (), 0, "--device cuda: "),
        ("cuda", 2, (), 1, "only 1 is visible"),
        ("cuda", 2, (0,), 2, "lists 1 GPU(s) for 2 rank(s)"),
        ("cpu", 1, (0,), 0, "--gpu-ids needs --device cuda"),
        ("tpu", 1, (), 0, "--device must be one of"),
    ],
)
def test_device_errors(device, world, ids, count, msg):
    with pytest.raises(ValueError) as e:
        check_devices(device, world, ids, cuda_count=count)
    assert msg in str(e.value)


def test_parse_gpu_ids():
    assert parse_gpu_ids("0, 2,1") == (0, 2, 1) and parse_gpu_ids(None) == ()
    with pytest.raises(ValueError, match="comma-separated"):
        parse_gpu_ids("0,x")


# ---- the fake flashinfer ----------------------------------------------------------------------------
class FakeMetadata:
    def __init__(self, **kw):
        self.__dict__.update(kw)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)


class FakeWrapper:
    """Asserts the 0.7.4 contract the adapter relies on and computes MLA decode in float64."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, backend="auto"):
        assert float_workspace_buffer.dtype == torch.uint8 and float_workspace_buffer.numel() >= 1 << 20
        assert backend in ("fa2", "fa3")
        self.plan_kw = None

    def plan(self, **kw):
        m = kw["metadata"]
        assert isinstance(m, FakeMetadata)
        B = m.qo_indptr.numel() - 1
        for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_len_arr):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.dim() == 1
        assert torch.equal(m.qo_indptr, torch.arange(B + 1, dtype=torch.int32))  # one query per row
        assert m.kv_indptr[0] == 0 and torch.equal(m.kv_indptr[1:] - m.kv_indptr[:-1], m.kv_len_arr)
        assert int(m.kv_indptr[-1]) == m.kv_indices.numel()
        assert kw["page_size"] == 1 and kw["causal"] is False
        assert kw["query_layout"] == "packed" and kw["kv_cache_layout"] == "packed"
        assert kw["lse_mode"] == "base2"
        assert set(kw) <= {
            "metadata", "num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal", "sm_scale",
            "q_data_type", "kv_data_type", "query_layout", "kv_cache_layout", "lse_mode",
        }  # fmt: skip
        self.plan_kw = kw

    def run(self, *, query, kv_cache, return_lse=False):
        kw = self.plan_kw
        assert kw is not None and return_lse is True
        B, H, D = query.shape
        assert (H, D) == (kw["num_heads"], kw["head_dim_ckv"] + kw["head_dim_kpe"])
        assert query.dtype == kw["q_data_type"] and kv_cache.dtype == kw["kv_data_type"]
        assert query.is_contiguous() and kv_cache.is_contiguous()
        assert kv_cache.dim() == 3 and kv_cache.shape[1] == 1 and kv_cache.shape[2] == D  # [pages, 1, D]
        m = kw["metadata"]
        assert m.kv_indices.numel() == 0 or int(m.kv_indices.max()) < kv_cache.shape[0]
        out = torch.full((B, H, kw["head_dim_ckv"]), float("nan"), dtype=query.dtype)  # empty rows: garbage
        lse = torch.full((B, H), 123.0)
        table = kv_cache[:, 0].double()
        for b in range(B):
            idx = m.kv_indices[m.kv_indptr[b] : m.kv_indptr[b + 1]].long()
            if idx.numel() == 0:
                continue
            s = torch.einsum("hd,sd->hs", query[b].double(), table[idx]) * kw["sm_scale"]
            lse_e = torch.logsumexp(s, -1)
            out[b] = (torch.softmax(s, -1) @ table[idx, : kw["head_dim_ckv"]]).to(query.dtype)
            lse[b] = (lse_e / math.log(2.0)).float()  # base 2, as the kernels return it
        return out, lse


def fake_top_k(input, k, sorted=False, deterministic=False, tie_break=0, dsa_graph_safe=False):
    assert input.dtype in (torch.float32, torch.float16, torch.bfloat16) and input.dim() == 2
    assert deterministic is True and tie_break == 1  # SMALL: the earlier index wins a tie
    S = input.shape[1]
    assert 0 < k <= S
    # larger value first; among equal values the smaller index: sort by (-value, index)
    order = torch.stack([torch.tensor(sorted_row(input[b])) for b in range(input.shape[0])])
    idx = order[:, :k]
    perm = torch.randperm(k)  # unsorted output: the adapter must sort
    return input.gather(1, idx)[:, perm], idx[:, perm]


def sorted_row(row):
    return [i for _, i in sorted(((-float(v), i) for i, v in enumerate(row.tolist())))]


def fake_flashinfer():
    fi = types.SimpleNamespace()
    fi.mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeWrapper, MLAPlanMetadata=FakeMetadata)
    fi.topk = types.SimpleNamespace(TopKTieBreak=types.SimpleNamespace(NONE=0, SMALL=1, LARGE=2))
    fi.top_k = fake_top_k
    return fi


def _ops():
    return FlashinferOps(torch.device("cpu"), "fa3", flashinfer_module=fake_flashinfer())


@pytest.mark.parametrize("shared", [True, False])
def test_adapter_attend_matches_torch_ops(shared):
    g = torch.Generator().manual_seed(0)
    B, H, S, dv, rope = 4, 3, 9, 16, 8
    q = torch.randn(B, H, dv + rope, generator=g)
    keys = torch.randn(S, dv + rope, generator=g) if shared else torch.randn(B, S, dv + rope, generator=g)
    valid = torch.rand(B, S, generator=g) > 0.4
    valid[2] = False  # a row with no key: lse -inf, out exactly 0
    ops = _ops()
    out, lse = ops.attend(q, keys, valid, 0.3, dv)
    ref_out, ref_lse = TorchOps().attend(q, keys, valid, 0.3, dv)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # natural log
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()
    ops.attend(q, keys, valid.clone(), 0.3, dv)  # same rows again: the plan is reused
    assert ops.plans == 1
    valid[0, 0] = not valid[0, 0]
    ops.attend(q, keys, valid, 0.3, dv)
    assert ops.plans == 2


def test_adapter_topk_tie_rule_and_padding():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    valid = torch.tensor([[True] * 6, [True, False, True, False, False, False]])
    ops = _ops()
    for k in (2, 3, 4, 8):
        assert torch.equal(ops.topk(scores, valid, k), TorchOps().topk(scores, valid, k)), k
    assert ops.topk(scores, valid, 2).tolist() == [[1, 2], [0, 2]]  # ties: the earlier keys win
    assert ops.topk(scores, valid, 4).tolist()[1] == [0, 2, -1, -1]  # fewer valid keys than k


def test_adapter_merge_is_the_exact_merge():
    outs = torch.randn(3, 2, 4, 5)
    lses = torch.randn(3, 2, 4)
    lses[1, 0] = float("-inf")
    a, b = _ops().merge(outs, lses)
    c, d = TorchOps().merge(outs, lses)
    assert torch.equal(a, c) and torch.equal(b, d)


# ---- indexer scores over a pool: no float32 copy of every key --------------------------------------
class _LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op made while it was open."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.most = max(self.most, t.numel())
        return out


def _index_case(kv_cache_dtype: str, dtype: torch.dtype, weights_dtype: torch.dtype, s: int = 50):
    cfg = ModelConfig.from_dict(hf_config("glm_moe_dsa", "tiny"))
    layer = cfg.indexer_layers[0]
    pool = KVPool(cfg, 64, dtype, kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(5)
    pool.write_index(layer, torch.arange(64), torch.randn(64, cfg.index_head_dim, generator=g, dtype=dtype))
    B, Hi, Di = 3, cfg.index_n_heads, cfg.index_head_dim
    index = IndexerInputs(
        q=torch.randn(B, Hi, Di, generator=g, dtype=dtype),
        k=None,
        weights=torch.rand(B, Hi, generator=g, dtype=weights_dtype),
        softmax_scale=Di**-0.5,
    )
    rows = torch.stack([torch.randperm(64, generator=g)[:s] for _ in range(B)])
    return pool, layer, rows, index


@pytest.mark.parametrize(
    "kv_cache_dtype,dtype",
    [("auto", torch.bfloat16), ("fp8_e4m3", torch.bfloat16), ("fp8_e4m3", torch.float32)],
)
def test_cached_index_scores_in_pieces_equal_the_whole(kv_cache_dtype, dtype):
    pool, layer, rows, index = _index_case(kv_cache_dtype, dtype, torch.float32)
    whole = index_scores(index.q, index.weights, pool.read_index(layer, rows), index.softmax_scale)
    B, S, Di = *rows.shape, pool.index_k.shape[-1]
    piece = 7 * B * Di * 4  # 7 columns a piece: 50 = 7 x 7 + 1
    with _LargestFloat32() as seen:
        got = cached_index_scores(pool, layer, rows, index, chunk_bytes=piece)
    assert got.dtype == torch.float32 and got.shape == (B, S)
    torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6)
    # the largest float32 tensor: a piece's keys [B, 7, Di] or per-head scores [B, Hi, 7], the queries
    # [B, Hi, Di] or the answer [B, S]
    Hi = index.q.shape[1]
    assert seen.most <= max(B * 7 * max(Di, Hi), B * Hi * Di, B * S) < B * S * Di
    with _LargestFloat32() as seen:
        cached_index_scores(pool, layer, rows, index)
    assert seen.most >= B * S * Di  # one piece: every key converted at once (what the pieces avoid)
    assert torch.equal(cached_index_scores(pool, layer, rows, index), whole)  # one piece: the same call
    empty = cached_index_scores(pool, layer, rows[:, :0], index, chunk_bytes=piece)
    assert empty.shape == (B, 0)


def test_cached_index_scores_float64_is_unchanged():
    """Keys stored in the scores' dtype (the float64 model path) are scored at once, whatever the piece
    size: bit for bit what index_scores of every key gives."""
    pool, layer, rows, index = _index_case("auto", torch.float64, torch.float64)
    whole = index_scores(index.q, index.weights, pool.read_index(layer, rows), index.softmax_scale)
    assert torch.equal(cached_index_scores(pool, layer, rows, index, chunk_bytes=1), whole)
