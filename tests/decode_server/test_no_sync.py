"""A decode step never syncs with the host (issue 39 item 4): real rank processes run every step
under runtime/sync_check.forbid_host_sync (`DecodeWorkerConfig.forbid_host_sync`), single rank, TP
and DCP, the dense MLA and the DSA model, and still decode exactly like the single-rank engine
(float64 logits within 1e-8, the same greedy tokens), also in padded bucket shapes (what cuda runs:
padding rows in the DCP collectives and the split index's candidate exchange). A rank that synced would raise, and the step
would fail. In-process: the check does bite on the step's path (the grouped torch MoE syncs), the
sync-free MoE it takes instead equals it in float64, and float32 (native kernels) and fp8-cache
steps do not sync either."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.decode_server.dcp_backend import DCPBackend, DCPGroup
from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.rank_worker import step_forward
from pdserve.decode_server.step_metadata import StepMetadata
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.layers import Experts
from pdserve.model.moe_ops import moe_dense
from pdserve.model.weights import load_model
from pdserve.request import SamplingParams
from pdserve.runtime.comm import GlooComm
from pdserve.runtime.launcher import LaunchConfig
from pdserve.runtime.sync_check import HostSyncError, forbid_host_sync
from tests.reference import assert_close, free_port, reference_prefill

STEPS = 4
PROMPTS = (1, 11, 70)  # shorter than C_d, a few pages, past the indexer's top-k


@pytest.fixture(scope="module")
def expected(tiny_checkpoints):
    """Per architecture and prompt: (ids, greedy tokens, decode logits, prompt cache), float64."""
    out = {}
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in PROMPTS]
    for arch in ("glm_moe_dsa", "deepseek_v3"):
        engine = LLMEngine.from_pretrained(
            tiny_checkpoints[(arch, "make-model")], "float64", float32_islands=False, max_kv_tokens=512
        )
        out[arch] = []
        for ids in prompts:
            tokens = engine.generate([ids], SamplingParams(max_tokens=STEPS + 1, ignore_eos=True))[0]
            logits = engine.prefill_logits(ids + tokens[:-1])[len(ids) :]
            out[arch].append((ids, tokens, logits, reference_prefill(engine, ids)[1]))
    return out


def decode_checked(inst: DecodeInstance, cases, tag: str) -> None:
    pages, seqs = [], []
    for ids, tokens, _, entries in cases:
        p = inst.allocator.allocate(len(ids) + STEPS + 1)
        inst.load(p, torch.stack([entries[l][0] for l in sorted(entries)]), {
            l: e[1] for l, e in entries.items() if e[1] is not None
        })  # fmt: skip
        pages.append(p)
        seqs.append(list(ids) + [tokens[0]])
    for step in range(STEPS):
        logits = inst.step([s[-1] for s in seqs], pages, [len(s) for s in seqs])
        for i, (ids, tokens, want, _) in enumerate(cases):
            assert_close(logits[i], want[step], f"{tag} prompt {len(ids)} step {step}")
            seqs[i].append(int(logits[i].argmax()))
            assert seqs[i][-1] == tokens[step + 1], f"{tag} prompt {len(ids)} step {step}"
    for p in pages:
        inst.allocator.free(p)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,tp,dcp,pad",
    [
        ("glm_moe_dsa", 1, 1, False),
        ("glm_moe_dsa", 2, 1, False),
        ("glm_moe_dsa", 2, 2, False),
        ("deepseek_v3", 2, 2, False),
        ("glm_moe_dsa", 2, 2, True),  # as on cuda: 3 requests in bucket 4, page tables 32 wide
    ],
)
def test_decode_step_does_not_sync(tiny_checkpoints, expected, arch, tp, dcp, pad):
    worker = DecodeWorkerConfig(
        str(tiny_checkpoints[(arch, "make-model")]),
        num_slots=512,
        dcp_size=dcp,
        dtype="float64",
        float32_islands=False,
        forbid_host_sync=True,
        pad_steps=pad,
    )
    with DecodeInstance(worker, LaunchConfig(tp, free_port()), page_size=4) as inst:
        modes = (
            [("copy", "a2a"), ("split", "ag_rs")] if dcp > 1 and arch == "glm_moe_dsa" else [("copy", "a2a")]
        )
        for index_mode, comm in modes:
            inst.reconfigure(index_mode, comm)
            decode_checked(inst, expected[arch], f"{arch} W={tp} C_d={dcp} {index_mode}/{comm}")


def _routed(seed: int, tokens: int):
    g = torch.Generator().manual_seed(seed)
    ex = Experts(6, 16, 8)
    ex.gate_up_proj.data = torch.randn(6, 16, 16, generator=g, dtype=torch.float64)
    ex.down_proj.data = torch.randn(6, 16, 8, generator=g, dtype=torch.float64)
    x = torch.randn(tokens, 16, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(tokens)])
    return ex, x, torch.rand(tokens, 3, generator=g, dtype=torch.float64), ids


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_check_bites_and_the_static_moe_equals_the_grouped_one(tokens):
    """The grouped torch MoE (one token: its experts' ids read on the host; more: bincount) raises
    under the check; with static_shapes (what decode ranks set) it does not, and its float64 result
    equals the grouped one (products of the same rows, summed in the same expert order)."""
    ex, x, weights, ids = _routed(tokens, tokens)
    with torch.inference_mode():
        want = ex(x, weights, ids)
        with pytest.raises(HostSyncError), forbid_host_sync():
            ex(x, weights, ids)
        ex.static_shapes = True
        with forbid_host_sync():
            got = ex(x, weights, ids)
    assert_close(got, want, "static vs grouped MoE", tol=1e-13)
    e2 = torch.tensor([[-1, 2, 2]])  # another rank's expert (-1) adds nothing
    one = moe_dense(x[:1], ex.gate_up_proj, ex.down_proj, weights[:1], e2)
    assert_close(
        one, moe_dense(x[:1], ex.gate_up_proj, ex.down_proj, weights[:1, 1:].sum(1, True), e2[:, 1:2]), "-1"
    )


@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.float32, "auto"), (torch.float32, "fp8_e4m3")])
def test_float32_and_fp8_cache_steps_do_not_sync(tmp_path, dtype, kv_cache_dtype):
    """The paths the float64 ranks above do not take: float32 on the CPU (the native kernels,
    native/ops.py) and an fp8 cache (per-key scales written and read), a padded bucket."""
    path = make_model(tmp_path / "m", "glm_moe_dsa", "tiny", seed=4)
    model = load_model(path, dtype, torch.device("cpu"))
    for m in model.modules():
        if isinstance(m, Experts):
            m.static_shapes = True
    pool = KVPool(
        model.config, 256, dtype, "cpu", kv_cache_dtype=kv_cache_dtype, index_slots=256, scratch=True
    )
    backend = DCPBackend(model.config, pool, DCPGroup(0, 1, GlooComm(0, 1)), "copy", "a2a", False)
    meta = StepMetadata(torch.device("cpu"), 16, 16, 8, pad=True)
    inputs = meta.fill([5, 7, 9], [[0, 1, 2], [3], [4, 5]], [40, 3, 20])  # 40 > the tiny top-k
    with torch.inference_mode(), forbid_host_sync():
        logits = step_forward(model, backend, inputs, logits=True)
    assert logits.shape == (4, model.config.vocab_size) and torch.isfinite(logits[:3]).all()
