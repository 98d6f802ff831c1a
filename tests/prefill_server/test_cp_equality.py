"""docs/design.md invariant 2 for prefill: a prefill instance of C_p real rank processes (gloo) stores
exactly the cache entries, and computes exactly the first-token logits, of the single-rank engine.

Float64, max abs difference <= 1e-8, for C_p in {1, 2, 3, 4}, every allowed layout, both storage
modes, with and without --moe-tp (in CI each (C_p, layout) with one rotating storage mode; the whole
grid with `pytest --deep`), chunk sizes {whole prompt, 7, 64}, prompt lengths
{1, C_p - 1, C_p + 1, index_topk + 1, 257}, plus a cached prefix where only the new tokens are split;
and --moe-ep (experts by id: all-to-all dispatch, or with --moe-tp none) against the same reference.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.layouts import ALLOWED_LAYOUTS
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, assert_prefill_cache, free_port
from tests.reference import reference_prefill as reference

TOPK = 8
ARCHS = ("glm_moe_dsa", "deepseek_v3")
CONFIGS = [
    (arch, cp, layout, cache, moe_tp)
    for arch in ARCHS
    for cp in (1, 2, 3, 4)
    for layout in (ALLOWED_LAYOUTS[arch] if cp > 1 else ALLOWED_LAYOUTS[arch][:1])  # one split when C = 1
    for cache in ("full", "layer-split")
    for moe_tp in (False, True)
]
STORAGE = [("full", False), ("layer-split", True), ("full", True), ("layer-split", False)]


def ci_configs() -> list[tuple]:
    """Every (architecture, C_p, layout) with one storage mode each, rotating through all four
    (cache, moe-tp) pairs, so each value of every dimension is covered: 14 of the 56 grid points.
    The randomized sweep (tests/sweep) draws the rest of the space end to end; `pytest --deep`
    runs the whole grid here."""
    points = sorted({c[:3] for c in CONFIGS}, key=lambda c: CONFIGS.index((*c, "full", False)))
    return [(*point, *STORAGE[i % len(STORAGE)]) for i, point in enumerate(points)]


def pytest_generate_tests(metafunc):
    if "moe_tp" in metafunc.fixturenames:
        configs = CONFIGS if metafunc.config.getoption("--deep") else ci_configs()
        metafunc.parametrize("arch,cp,layout,cache,moe_tp", configs)


def check_instance(inst: PrefillInstance, engine: LLMEngine, ids: list[int], chunk: int, tag: str) -> None:
    want_logits, want_entries = reference(engine, ids)
    res = inst.prefill(f"r-{tag}", ids, SamplingParams(), chunk_size=chunk, want_logits=True)
    assert_close(res.logits, want_logits, f"{tag} logits")
    assert res.token == int(want_logits.argmax())
    held = assert_prefill_cache(inst, res.slots, want_entries, tag)
    assert held == set(range(engine.config.num_layers)), f"{tag}: layers held {sorted(held)}"
    inst.release(res.request_id)


@pytest.mark.slow
def test_prefill_instance_matches_single_rank(tiny_checkpoints, arch, cp, layout, cache, moe_tp):
    path = str(tiny_checkpoints[(arch, "make-model")])
    # true float64 on both sides: the reference's float32 islands would round 1e-16 reorderings to 1e-7
    engine = LLMEngine.from_pretrained(path, "float64", float32_islands=False, max_kv_tokens=512)
    worker = PrefillWorkerConfig(
        path,
        num_slots=1024,
        dtype="float64",
        layout=layout,
        cache=cache,
        moe_tp=moe_tp,
        query_block=16,
        float32_islands=False,
    )
    with PrefillInstance(worker, LaunchConfig(cp, free_port())) as inst:
        lengths = sorted({1, max(cp - 1, 1), cp + 1, TOPK + 1, 257})
        for n, chunk in itertools.product(lengths, (None, 7, 64)):
            ids = torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            check_instance(inst, engine, ids, chunk or n, f"n={n} chunk={chunk}")
        # a cached prefix: only the new tokens are split across the ranks
        ids = torch.randint(4, 500, (70,), generator=torch.Generator().manual_seed(70)).tolist()
        first = inst.prefill("prefix", ids[:32], chunk_size=7)
        res = inst.prefill("full", ids, chunk_size=7, want_logits=True, prefix_of="prefix", cached_len=32)
        want_logits, _ = reference(engine, ids)
        assert_close(res.logits, want_logits, "cached prefix logits")
        inst.release("full")
        assert first.request_id not in inst.held and not inst.held
        inst.allocator.check_integrity()
        assert inst.allocator.num_free == inst.allocator.num_pages


@pytest.mark.parametrize(
    "arch,cp,with_tp",
    [
        ("glm_moe_dsa", 2, False),
        pytest.param("deepseek_v3", 4, False, marks=pytest.mark.slow),
        ("glm_moe_dsa", 2, True),
    ],
    ids=["glm-c2-a2a", "dsv3-c4-a2a", "glm-c2-with-moe-tp"],
)
def test_moe_ep_prefill_matches_single_rank(tiny_checkpoints, arch, cp, with_tp):
    """--moe-ep: each rank holds E/C_p whole experts. Alone, every MoE block sends each token to the
    ranks of its experts and back by all-to-all (a 1-token prompt leaves the other ranks with no
    token: they send nothing but still compute what they receive); with --moe-tp the block already
    sees every token and the reduce-scatter sums the ranks' experts. Logits and cache entries as
    the single rank's (float64, 1e-8: the expert outputs are summed per rank, then over ranks)."""
    path = str(tiny_checkpoints[(arch, "make-model")])
    engine = LLMEngine.from_pretrained(path, "float64", float32_islands=False, max_kv_tokens=512)
    worker = PrefillWorkerConfig(
        path,
        num_slots=1024,
        dtype="float64",
        layout=ALLOWED_LAYOUTS[arch][0],
        moe_tp=with_tp,
        moe_ep=True,
        query_block=16,
        float32_islands=False,
    )
    with PrefillInstance(worker, LaunchConfig(cp, free_port())) as inst:
        for n, chunk in itertools.product((1, cp + 1, 70), (None, 7)):
            ids = torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            check_instance(inst, engine, ids, chunk or n, f"--moe-ep C_p={cp} n={n} chunk={chunk}")
        infos = inst.rank_infos
    assert len({r.weight_bytes for r in infos}) == 1  # as many whole experts on every rank
