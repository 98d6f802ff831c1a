"""No tensor is created on the wrong device: the engine, the CP backend, the DCP backend and the
KV pool's hand-off packing run with torch's default device set to "meta" and every input on the
CPU. A tensor created without `device=` lands on meta, and the first op mixing it with a CPU
tensor raises, so on CUDA the same code cannot silently build a CPU tensor (or the reverse).
Results must also equal a run without the meta default."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.decode_server.dcp_backend import DCPBackend, DCPGroup, DecodeBatch
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.weights import load_model
from pdserve.prefill_server.cp_backend import ChunkPlan, CPBackend
from pdserve.request import SamplingParams
from pdserve.runtime.comm import GlooComm
from pdserve.transfer.plan import Run
from pdserve.transfer.room_rows import SLICE_RUNS
from pdserve.transfer.tcp import pack_rows


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("hyg") / "m", "glm_moe_dsa", "tiny", seed=3)
    return load_model(path, torch.float32)


class _MetaDefault:
    def __enter__(self):
        torch.set_default_device("meta")

    def __exit__(self, *exc):
        torch.set_default_device(None)


def test_meta_default_catches_a_tensor_without_device():
    """The check itself can fail: a stray device-less tensor meets a CPU one and raises."""
    with _MetaDefault(), pytest.raises((RuntimeError, NotImplementedError)):
        torch.ones(3, device="cpu") + torch.zeros(3)


def test_engine_generates_under_meta_default(model):
    prompt = list(range(5, 45))  # longer than the tiny model's top-k: the indexer selects
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = LLMEngine(model, max_kv_tokens=256, page_size=16, attention_ops="torch").generate(
        [prompt], params
    )
    with _MetaDefault():
        engine = LLMEngine(model, max_kv_tokens=256, page_size=16, attention_ops="torch")
        got = engine.generate([prompt], params)
        logits = engine.prefill_logits(prompt[:20])
    assert got == expected
    assert logits.device.type == "cpu" and logits.shape[0] == 20


def _cp_forward(model, pool):
    cfg = model.config
    n = 40
    slots = torch.arange(n, dtype=torch.int64, device="cpu")
    backend = CPBackend(cfg, pool, rank=0, cp_size=1)
    plan = ChunkPlan(0, n, [list(range(n))], slots)
    backend.begin(plan)
    ids = torch.arange(3, 3 + n, dtype=torch.int64, device="cpu")
    hidden = model(ids, torch.arange(n, dtype=torch.int64, device="cpu"), backend)
    backend.finish()
    return hidden


def test_cp_backend_under_meta_default(model):
    cfg = model.config
    expected = _cp_forward(model, KVPool(cfg, 64, torch.float32, device="cpu"))
    with _MetaDefault(), torch.inference_mode():
        got = _cp_forward(model, KVPool(cfg, 64, torch.float32, device="cpu"))
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("index_mode", ["copy", "split"])
def test_dcp_backend_under_meta_default(model, index_mode):
    cfg = model.config
    prefix = 30

    def run():
        pool = KVPool(cfg, 64, torch.float32, device="cpu", scratch=True)
        group = DCPGroup(0, 1, GlooComm(0, 1))
        backend = DCPBackend(cfg, pool, group, index_mode, "a2a", replicate_q=False)
        pages = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32, device="cpu")
        backend.begin(DecodeBatch(pages, torch.tensor([prefix + 1, prefix + 2], device="cpu"), 16))
        ids = torch.tensor([7, 9], dtype=torch.int64, device="cpu")
        pos = torch.tensor([prefix, prefix + 1], dtype=torch.int64, device="cpu")
        with torch.inference_mode():
            return model(ids, pos, backend)

    expected = run()
    with _MetaDefault():
        got = run()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_pool_packing_under_meta_default(model):
    """What a hand-off sender does with the pool: write, span, read_into a staging buffer, and the
    senders' packing of plan runs (a few runs: slice copies; many: one gather of run_rows)."""
    cfg = model.config
    with _MetaDefault():
        pool = KVPool(cfg, 64, torch.float32, device="cpu", residues=2)
        rows = torch.arange(10, dtype=torch.int64, device="cpu")
        kv = torch.randn(10, cfg.kv_entry_dim, device="cpu")
        pool.write_kv(0, rows, kv)
        staging = torch.empty(5, cfg.kv_entry_dim, device="cpu")
        pool.read_into("kv", 0, rows[::2], staging)
        span = pool.span("kv", 0, 0, 5, 2)
        pool.read_into("kv", 0, slice(0, 10, 2), staging)
        few = torch.empty(6, cfg.kv_entry_dim, device="cpu")
        pack_rows(pool, "kv", 0, [Run(0, 0, 3, 2), Run(1, 3, 3, 1)], few)
        many_runs = [Run(i % 10, i, 1) for i in range(SLICE_RUNS + 1)]
        many = torch.empty(len(many_runs), cfg.kv_entry_dim, device="cpu")
        pack_rows(pool, "kv", 0, many_runs, many)
    torch.testing.assert_close(staging, kv[::2])
    torch.testing.assert_close(span, kv[::2])
    torch.testing.assert_close(few, kv[[0, 2, 4, 1, 2, 3]])
    torch.testing.assert_close(many, kv[[i % 10 for i in range(SLICE_RUNS + 1)]])
