"""Static decode metadata (decode_server/step_metadata.py) and the graph bookkeeping
(decode_server/cuda_graphs.py), on the CPU.

The slots and masks derived on the device from a bucket's page table and lengths equal the
per-request slot lists the host used to build (the eager step's); a padded bucket's step gives the
unpadded eager step's logits rows in float64 (bitwise where the products have the same shapes:
padding rows never reach a real row) and writes nothing but the scratch row besides the real rows; replaying a step captured for a bucket (a stand-in capture that re-runs the recorded
closure, as a CUDA graph re-runs its kernels over the same buffers) equals the eager step."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.decode_server.cuda_graphs import StepGraphs, graph_blocker, use_graphs
from pdserve.decode_server.dcp_backend import DCPBackend, DCPGroup
from pdserve.decode_server.rank_worker import step_forward
from pdserve.decode_server.step_metadata import (
    StepMetadata,
    batch_buckets,
    bucket_of,
    derive_slots,
    width_of,
)
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.layers import Experts
from pdserve.model.weights import load_model
from pdserve.runtime.comm import GlooComm
from pdserve.runtime.sync_check import forbid_host_sync

CPU = torch.device("cpu")
P = 4  # page size
SLOTS = 256


def host_slots(pages: list[int], n: int, page_size: int) -> list[int]:
    """The eager step's slot list of one request (what StepCmd.slots() built on the host)."""
    return [pages[p // page_size] * page_size + p % page_size for p in range(n)]


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(1) == (1,)
    assert [bucket_of(n, batch_buckets(6)) for n in (1, 2, 3, 5, 6, 7)] == [1, 2, 4, 6, 6, 8]
    assert [width_of(p, 12) for p in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


@pytest.mark.parametrize("pad", [False, True])
def test_bucket_slots_equal_the_host_slot_lists(pad):
    rng = random.Random(4)
    meta = StepMetadata(CPU, P, SLOTS // P, max_batch=16, pad=pad)
    for trial in range(20):
        n = rng.randint(1, 16)
        lengths = [rng.randint(1, 40) for _ in range(n)]
        pages = [rng.sample(range(SLOTS // P), -(-s // P) + rng.randint(0, 2)) for s in lengths]
        inputs = meta.fill(list(range(n)), pages, lengths)
        B, W = inputs.page_table.shape
        assert (B, W) == ((bucket_of(n, meta.buckets), width_of(max(-(-s // P) for s in lengths), 64))
                          if pad else (n, max(-(-s // P) for s in lengths))), trial  # fmt: skip
        slots, valid = derive_slots(inputs.page_table, inputs.lengths, P)
        for i in range(n):
            assert slots[i][valid[i]].tolist() == host_slots(pages[i], lengths[i], P), (trial, i)
            assert valid[i].tolist() == [p < lengths[i] for p in range(W * P)]
        assert not valid[n:].any() and (inputs.lengths[n:] == 0).all() and inputs.rows == n
        assert inputs.positions[:n].tolist() == [s - 1 for s in lengths]


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v3"])
def model(request, tmp_path_factory):
    path = make_model(tmp_path_factory.mktemp("meta") / "m", request.param, "tiny", seed=2)
    m = load_model(path, torch.float64, CPU, float32_islands=False)
    for mod in m.modules():
        if isinstance(mod, Experts):
            mod.static_shapes = True
    return m


def _rank(model) -> DCPBackend:
    """A single decode rank's pool (every slot random, as after many requests) and backend."""
    pool = KVPool(model.config, SLOTS, torch.float64, CPU, index_slots=SLOTS, scratch=True)
    g = torch.Generator().manual_seed(1)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g, dtype=torch.float64))
    pool.index_k.copy_(torch.randn(pool.index_k.shape, generator=g, dtype=torch.float64))
    return DCPBackend(model.config, pool, DCPGroup(0, 1, GlooComm(0, 1)), "copy", "a2a", False)


BATCH = ([11, 12, 13], [[5, 9, 2, 7, 30, 31], [3, 4], [40, 41, 42]], [21, 2, 9])  # 3 requests: bucket 4
FOURTH = ([14], [[50, 51]], [6])  # a real request where BATCH's bucket has its padding row


@torch.inference_mode()
def test_padded_bucket_step_equals_the_eager_step(model):
    """Rows 0-2 of the padded bucket (4 rows, 8 pages wide) against the unpadded eager step (3 rows,
    6 pages): equal within 1e-13 in float64 -- not bitwise, since the CPU BLAS (MKL) sums a product
    of 3 rows in another order than one of 4 or 8 (F.linear of the same rows differs by 1e-14); and
    bitwise against the same bucket whose fourth row is a real request: what fills the padding never
    reaches a real row. The pool holds the same slots after either step: padding wrote the scratch
    row only."""
    eager, padded, full = _rank(model), _rank(model), _rank(model)
    want = step_forward(model, eager, StepMetadata(CPU, P, 16, 8, pad=False).fill(*BATCH), logits=True)
    inputs = StepMetadata(CPU, P, 16, 8, pad=True).fill(*BATCH)
    assert inputs.key == (4, 8)
    with forbid_host_sync():
        got = step_forward(model, padded, inputs, logits=True)
    assert got.shape[0] == 4
    assert (got[:3] - want).abs().max() <= 1e-13
    four = [a + b for a, b in zip(BATCH, FOURTH)]
    other = step_forward(model, full, StepMetadata(CPU, P, 16, 8, pad=True).fill(*four), logits=True)
    assert torch.equal(got[:3], other[:3])
    written = [host_slots(p, n, P)[-1] for p, n in zip(BATCH[1], BATCH[2])]
    kept = torch.ones(SLOTS, dtype=torch.bool)
    kept[written] = False  # the rest, scratch row excluded, is untouched by either step
    for table in ("kv", "index_k") if model.config.is_sparse else ("kv",):
        a, b = getattr(padded.pool, table), getattr(eager.pool, table)
        assert torch.equal(a[:, :SLOTS][:, kept], b[:, :SLOTS][:, kept]), table
        assert (a[:, written] - b[:, written]).abs().max() <= 1e-13, table
        assert not torch.equal(b[:, written], getattr(_rank(model).pool, table)[:, written])  # written


class ReplayCapture:
    """A CPU stand-in for CudaCapture: replay re-runs the closure recorded at capture time (the
    first step of the shape, over that step's buffers) into the output tensor, as a graph re-runs
    its kernels over the same addresses."""

    def __init__(self):
        self.captures = 0

    def __call__(self, forward):
        self.captures += 1
        out = forward()
        return (lambda: out.copy_(forward())), out


@torch.inference_mode()
def test_replay_of_a_bucket_equals_the_eager_step(model):
    capture = ReplayCapture()
    graphs = StepGraphs(capture)
    replayed, eager = _rank(model), _rank(model)
    meta, eager_meta = StepMetadata(CPU, P, 16, 8, pad=True), StepMetadata(CPU, P, 16, 8, pad=True)
    tokens, pages, lengths = BATCH
    for step in range(3):  # the same bucket (4, 8) each step: one capture, then replays
        lengths = [n + 1 for n in lengths]
        inputs = meta.fill(tokens, pages, lengths)
        got = graphs.run(inputs.key, lambda inputs=inputs: step_forward(model, replayed, inputs, logits=True))
        want = step_forward(model, eager, eager_meta.fill(tokens, pages, lengths), logits=True)
        assert torch.equal(got[:3], want[:3]), step
        tokens = [int(t) for t in want[:3].argmax(-1)]
    assert capture.captures == 1 and graphs.keys == [(4, 8)]
    inputs = meta.fill(tokens[:1], pages[:1], lengths[:1])  # another bucket: captured anew
    graphs.run(inputs.key, lambda: step_forward(model, replayed, inputs, logits=True))
    assert capture.captures == 2 and graphs.keys == [(4, 8), (1, 8)]


def test_graph_blockers_and_the_default():
    assert "cuda" in graph_blocker("cpu", 1, "cpu", "torch")
    assert "flashinfer" in graph_blocker("cuda", 1, "host", "flashinfer")
    assert "host memory" in graph_blocker("cuda", 2, "host", "torch")
    assert (
        graph_blocker("cuda", 1, "host", "torch") is None
        and graph_blocker("cuda", 4, "nccl", "torch") is None
    )
    assert (
        use_graphs("auto", None, "t")
        and not use_graphs("auto", "why", "t")
        and not use_graphs("off", None, "t")
    )
    with pytest.raises(ValueError, match="--cuda-graphs on cannot run: why"):
        use_graphs("on", "why", "t")
