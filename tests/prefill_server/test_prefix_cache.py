"""The prefill instance's prefix cache (--prefix-cache on) is exact: a prompt whose prefix is cached
prefills only the rest, split across the C_p ranks, and gets the first-token logits and cache entries
of the single-rank engine without a cache (float64, max abs difference <= 1e-8; docs/design.md
invariant 2), for a shared prefix that ends mid-page, exactly on a page boundary, covers the whole
prompt, and that was evicted and is recomputed; with chunked prefill; full and layer-split storage.
Every page is free or cached (unreferenced) between requests, and a flush returns them all."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, assert_prefill_cache, free_port, reference_prefill

PS = 4  # page size
CI = [("glm_moe_dsa", 1, "interleave", "full"), ("glm_moe_dsa", 2, "interleave", "layer-split")]
DEEP = [("glm_moe_dsa", 2, "interleave", "full"), ("deepseek_v3", 2, "zigzag", "layer-split")]


def pytest_generate_tests(metafunc):
    if "layout" in metafunc.fixturenames:
        deep = metafunc.config.getoption("--deep")
        metafunc.parametrize("arch,cp,layout,cache", CI + (DEEP if deep else []))


def check(inst: PrefillInstance, engine: LLMEngine, rid: str, ids: list[int], want_cached: int, chunk=None):
    want_logits, want_entries = reference_prefill(engine, ids)
    res = inst.prefill(rid, ids, chunk_size=chunk, want_logits=True)
    assert res.cached_len == want_cached, f"{rid}: {res.cached_len} cached tokens, expected {want_cached}"
    assert_close(res.logits, want_logits, f"{rid} logits")
    assert res.token == int(want_logits.argmax())
    held = assert_prefill_cache(inst, res.slots, want_entries, rid)  # cached rows and new rows alike
    assert held == set(range(engine.config.num_layers))
    inst.release(rid)
    inst.check_idle()


@pytest.mark.slow
def test_cached_prefix_prefill_matches_the_uncached_engine(tiny_checkpoints, arch, cp, layout, cache):
    path = str(tiny_checkpoints[(arch, "make-model")])
    engine = LLMEngine.from_pretrained(path, "float64", float32_islands=False, max_kv_tokens=256)
    worker = PrefillWorkerConfig(
        path,
        num_slots=256,
        dtype="float64",
        layout=layout,
        cache=cache,
        query_block=16,
        float32_islands=False,
    )
    g = torch.Generator().manual_seed(cp)
    a = torch.randint(4, 500, (37,), generator=g).tolist()
    tail = torch.randint(4, 500, (9,), generator=g).tolist()
    with PrefillInstance(worker, LaunchConfig(cp, free_port()), page_size=PS, prefix_cache=True) as inst:
        check(inst, engine, "cold", a, 0, chunk=7)  # nothing cached: 9 whole pages go into the tree
        assert inst.capacity()["cached_tokens"] == 36
        check(inst, engine, "mid-page", a[:30] + tail, 28)  # diverges inside page 7
        check(inst, engine, "boundary", a[:32] + tail, 32, chunk=5)  # diverges on a page boundary
        check(inst, engine, "whole", a, 36)  # every whole page cached: the last token is computed
        check(inst, engine, "whole-aligned", a[:36], 32)  # a page-aligned prompt recomputes its last page
        check(inst, engine, "extends", a + tail, 36, chunk=3)  # a next turn: the earlier prompt + more
        freed = inst.flush_cache()
        cap = inst.capacity()
        assert freed > 0 and cap["cached_tokens"] == 0 and cap["free_tokens"] == cap["total_tokens"]
        check(inst, engine, "evicted", a + tail, 0)  # evicted, then recomputed from scratch
        # pressure: 64 pages, every prompt needs 12: the allocator evicts LRU leaves on demand
        for i in range(8):
            other = torch.randint(4, 500, (46,), generator=torch.Generator().manual_seed(100 + i)).tolist()
            check(inst, engine, f"pressure-{i}", other, 0)
        assert inst.capacity()["evicted_tokens"] > 0
        check(inst, engine, "after-pressure", other[:41] + tail, 40)
