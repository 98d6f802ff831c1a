"""--cuda-graphs on one GPU (issue 39 item 4): a decode step replayed from its bucket's graph equals
the eager step bitwise (float64 and bf16), the logits and the cache rows it writes; an eager step
runs under torch.cuda.set_sync_debug_mode("error") (which does raise on a sync); and a decode rank
with --cuda-graphs on decodes like the single-rank engine (float64 within 1e-8, the same tokens)."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_server.cuda_graphs import StepGraphs
from pdserve.decode_server.dcp_backend import DCPBackend, DCPGroup
from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.rank_worker import step_forward
from pdserve.decode_server.step_metadata import StepMetadata
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.layers import Experts
from pdserve.model.weights import load_model
from pdserve.request import SamplingParams
from pdserve.runtime.comm import GlooComm
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, free_port, reference_prefill

CUDA = torch.device("cuda")
P, SLOTS = 4, 256
BATCH = ([11, 12, 13], [[5, 9, 2, 7, 30, 31, 32], [3, 4], [40, 41, 42]], [21, 2, 9])  # bucket (4, 8)


def _model(path: str, dtype: torch.dtype):
    model = load_model(path, dtype, CUDA, float32_islands=dtype != torch.float64)
    for m in model.modules():
        if isinstance(m, Experts):
            m.static_shapes = True  # what a decode rank sets
    return model


def _rank(model, dtype: torch.dtype) -> DCPBackend:
    pool = KVPool(model.config, SLOTS, dtype, CUDA, index_slots=SLOTS, scratch=True)
    g = torch.Generator(device=CUDA).manual_seed(1)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g, device=CUDA).to(dtype))
    pool.index_k.copy_(torch.randn(pool.index_k.shape, generator=g, device=CUDA).to(dtype))
    return DCPBackend(model.config, pool, DCPGroup(0, 1, GlooComm(0, 1)), "copy", "a2a", False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@torch.inference_mode()
def test_replay_equals_eager_bitwise(tiny, dtype):
    model = _model(tiny, dtype)
    graphs, replayed, eager = StepGraphs(), _rank(model, dtype), _rank(model, dtype)
    meta, eager_meta = StepMetadata(CUDA, P, 64, 8, pad=True), StepMetadata(CUDA, P, 64, 8, pad=True)
    tokens, pages, lengths = BATCH
    for step in range(4):  # the first runs eagerly and captures; the others replay
        lengths = [n + 1 for n in lengths]
        inputs = meta.fill(tokens, pages, lengths)
        got = graphs.run(inputs.key, lambda inputs=inputs: step_forward(model, replayed, inputs, logits=True))
        want = step_forward(model, eager, eager_meta.fill(tokens, pages, lengths), logits=True)
        torch.cuda.synchronize()
        assert torch.equal(got[:3], want[:3]), step
        tokens = want[:3].argmax(-1).tolist()
    assert graphs.keys == [(4, 8)]
    assert torch.equal(replayed.pool.kv[:, :SLOTS], eager.pool.kv[:, :SLOTS])
    assert torch.equal(replayed.pool.index_k[:, :SLOTS], eager.pool.index_k[:, :SLOTS])


@torch.inference_mode()
def test_a_step_does_not_sync(tiny):
    model = _model(tiny, torch.bfloat16)
    backend, meta = _rank(model, torch.bfloat16), StepMetadata(CUDA, P, 64, 8, pad=True)
    step_forward(model, backend, meta.fill(*BATCH), logits=True)  # warm-up: lazy tables, handles
    inputs = meta.fill(*BATCH)  # outside: it waits for the last copy out of its pinned buffer
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step_forward(model, backend, inputs, logits=True)  # raises on any sync
        with pytest.raises(RuntimeError, match="synchroniz"):
            out.sum().item()  # the mode does bite
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (4, model.config.vocab_size) and torch.isfinite(out[:3].float()).all()


def test_decode_rank_with_graphs_equals_the_engine(tiny):
    engine = LLMEngine.from_pretrained(tiny, "float64", float32_islands=False, max_kv_tokens=512)
    ids = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    want = engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    want_logits = engine.prefill_logits(ids + want[:-1])[len(ids) :]
    entries = reference_prefill(engine, ids)[1]
    worker = DecodeWorkerConfig(
        tiny, num_slots=512, dtype="float64", float32_islands=False, device="cuda", cuda_graphs="on"
    )
    launch = LaunchConfig(1, free_port(), device="cuda")
    with DecodeInstance(worker, launch, page_size=4) as inst:
        pages = inst.allocator.allocate(len(ids) + 8)
        inst.load(pages, torch.stack([entries[l][0] for l in sorted(entries)]), {
            l: e[1] for l, e in entries.items() if e[1] is not None
        })  # fmt: skip
        seq = list(ids) + [want[0]]
        for i in range(7):
            logits = inst.step([seq[-1]], [pages], [len(seq)])[0]
            assert_close(logits, want_logits[i], f"step {i}")
            seq.append(int(logits.argmax()))
        assert seq[len(ids) :] == want
