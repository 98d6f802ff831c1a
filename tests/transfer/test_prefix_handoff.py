"""Prefix caches on both sides of a KV hand-off are exact and ship only what the decode side lacks,
for the sparse (glm_moe_dsa) and the dense (deepseek_v3) model over NIXL and TCP, on real rank processes.

A multi-turn conversation runs through the production hand-off machines (tests/transfer/handoff_driver.py)
between a prefill instance and a decode instance, both with --prefix-cache on: the decode reservation
names the whole pages of the prompt the decode instance already holds (prompt and generated tokens of
earlier turns), the plan skips those rows, and with DCP the cached rows stay on their ranks. With
temperature 0 every request's tokens equal the single-rank engine's without any cache, and every
last decode step's logits and every decode rank's rows of the prompt equal the single-rank engine's
(float64, 1e-8), for prefixes that end
mid-page, on a page boundary, cover the whole prompt, and were evicted and are recomputed. Afterwards
every page is free or cached (unreferenced), and flushing returns them all. The mixed-fault loop
(failed hand-offs of every kind, aborts on both sides) with shared prefixes leaves the same, on both
models over NIXL and TCP.
"""

from __future__ import annotations

import pytest

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, free_port
from tests.servers import wait_until
from tests.transfer.fault_loop import run_mixed_faults
from tests.transfer.handoff_driver import Driver, hand_off
from tests.transfer.handoff_helpers import check_rows, prompt

pytestmark = pytest.mark.slow
PS = 4
CI = [  # both models (sparse and dense attention), both data paths; every pairing with --deep
    ("glm_moe_dsa", (2, "layer-split"), (2, 2), "split", "tcp"),
    ("glm_moe_dsa", (1, "full"), (1, 1), "copy", "nixl"),
    ("deepseek_v3", (1, "full"), (2, 2), "copy", "nixl"),
]
DEEP = [
    ("deepseek_v3", (2, "full"), (1, 1), "copy", "tcp"),
    ("glm_moe_dsa", (2, "full"), (2, 2), "copy", "tcp"),
    ("glm_moe_dsa", (1, "full"), (2, 2), "split", "tcp"),
    ("glm_moe_dsa", (2, "full"), (2, 2), "copy", "nixl"),
    ("deepseek_v3", (2, "layer-split"), (2, 1), "copy", "tcp"),
]


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_multi_turn_handoff_with_prefix_caches":
        deep = metafunc.config.getoption("--deep")
        metafunc.parametrize("arch,pshape,dshape,index_mode,transfer", CI + (DEEP if deep else []))


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    """arch -> (checkpoint path, its float64 single-rank engine), made on first use."""
    made = {}

    def get(arch: str):
        if arch not in made:
            path = str(tiny_checkpoints[(arch, "make-model")])
            made[arch] = (
                path,
                LLMEngine.from_pretrained(path, "float64", float32_islands=False, max_kv_tokens=512),
            )
        return made[arch]

    return get


def start_pair(path: str, pshape, dshape, index_mode, transfer="tcp", quarantine_s: float = 60.0):
    cp, cache = pshape
    pw = PrefillWorkerConfig(
        path,
        num_slots=256,
        dtype="float64",
        cache=cache,
        query_block=16,
        float32_islands=False,
        transfer=transfer,
    )
    prefill = PrefillInstance(pw, LaunchConfig(cp, free_port()), page_size=PS, prefix_cache=True).start()
    w, c = dshape
    dw = DecodeWorkerConfig(
        path,
        num_slots=256,
        dcp_size=c,
        index_mode=index_mode,
        dtype="float64",
        float32_islands=False,
        transfer=transfer,
        transfer_quarantine_s=quarantine_s,
    )
    inst = DecodeInstance(dw, LaunchConfig(w, free_port()), page_size=PS, prefix_cache=True)
    return prefill, DecodeStepDriver(inst.start(), keep_logits=True)  # the last step's logits are checked


def decode_idle(decode: DecodeStepDriver) -> None:
    """Every decode page is free or in the prefix cache, unreferenced."""
    alloc, cache = decode.instance.allocator, decode.instance.cache
    assert decode.scheduler.is_idle() and cache.protected_pages == 0
    alloc.check_integrity()
    cache.check_integrity()
    assert alloc.num_free + cache.cached_pages == alloc.num_pages


def test_multi_turn_handoff_with_prefix_caches(engines, arch, pshape, dshape, index_mode, transfer):
    model_path, single = engines(arch)
    prefill, decode = start_pair(model_path, pshape, dshape, index_mode, transfer)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    skipped = lambda: decode.instance.handoff_skipped_bytes  # noqa: E731

    def turn(ids: list[int], want_decode_cached: int, tag: str) -> list[int]:
        want = single.generate([ids], [params])[0]  # no cache anywhere
        before = skipped()
        req = hand_off(prefill, decode, ids, params)
        assert req.cached_len == want_decode_cached, f"{tag}: decode held {req.cached_len} tokens"
        check_rows(prefill, decode, single, ids, req.pages, None, tag)  # cached rows and sent rows
        decode.run_until_idle()
        assert req.output_ids == want, tag
        # the last step's logits (it reads every cached, sent and decoded row) against the uncached
        # single-rank prefill of the same tokens
        last = single.prefill_with_cache(ids + want[:-1])[0]
        assert_close(decode.last_logits[req.request_id], last, f"{tag} last step logits")
        assert (skipped() > before) == (want_decode_cached > 0), tag
        prefill.check_idle()
        decode_idle(decode)
        return req.output_ids

    try:
        system = prompt(22)  # 5 whole pages + 2 tokens
        turn1 = system + prompt(9)  # 31 tokens
        out1 = turn(turn1, 0, "first turn")
        # the decode instance kept turn1 + out1[:-1] = 36 tokens = 9 pages; the next turn resends them
        turn2 = turn1 + out1 + prompt(5)
        turn(turn2, 36, "second turn")
        turn(system + prompt(7)[:3], 20, "shared system prompt, ends mid-page")  # 25 tokens
        turn(turn1[:24] + prompt(23)[:6], 24, "on a page boundary")
        turn(turn1, 28, "whole prompt cached")  # 31 tokens: whole pages of the first 30
        assert decode.instance.flush_cache() > 0 and prefill.flush_cache() > 0
        turn(turn2, 0, "evicted, then recomputed")
        assert prefill.capacity()["prefix_hit_tokens"] > 0
    finally:
        decode.instance.flush_cache()
        prefill.flush_cache()
        cap = prefill.capacity()
        assert cap["free_tokens"] == cap["total_tokens"]
        alloc = decode.instance.allocator
        assert alloc.num_free == alloc.num_pages
        prefill.shutdown()
        decode.instance.shutdown()


NO_LEAK = [  # both models, both data paths (NIXL with its quarantine holds)
    ("glm_moe_dsa", (2, "full"), (2, 2), "copy", "nixl"),
    ("deepseek_v3", (2, "layer-split"), (2, 1), "copy", "tcp"),
]


@pytest.mark.parametrize("arch,pshape,dshape,index_mode,transfer", NO_LEAK)
def test_fault_loop_with_prefix_caches_leaves_only_cached_pages(
    request, engines, arch, pshape, dshape, index_mode, transfer
):
    """Seeded cases of the mixed-fault loop (tests/transfer/fault_loop.py: successes, corrupt and
    missing rows, aborts on either side in every state, failures mid-send) with prompts that share
    prefixes, through real ranks with prefix caches on both sides: every success decodes the
    single-rank engine's token (a stale cached page would change it), and afterwards -- once the
    quarantine holds expired -- every page is free or cached and unreferenced, and flushing returns
    them all. 40 cases per pairing here, 500 with --deep."""
    model_path, single = engines(arch)
    prefill, decode = start_pair(model_path, pshape, dshape, index_mode, transfer, quarantine_s=0.5)
    systems = [prompt(n) for n in (6, 13, 22)]
    driver = Driver(prefill, decode, heartbeat_timeout_s=2.0)
    one = SamplingParams(max_tokens=1)
    try:
        run_mixed_faults(
            driver,
            500 if request.config.getoption("--deep") else 40,
            seed=1,
            quarantine=transfer == "nixl",
            prompt=lambda rng: rng.choice(systems) + prompt(rng.randint(1, 9)),
            first_token=lambda ids: single.generate([ids], [one])[0][0],
        )
        prefill.check_idle()
        alloc = decode.instance.allocator
        wait_until(lambda: not alloc.num_held, "the quarantine holds to expire", timeout_s=10)
        decode_idle(decode)
        assert decode.instance.cache.hit_tokens > 0 and prefill.cache.hit_tokens > 0
        decode.instance.flush_cache()
        prefill.flush_cache()
        assert prefill.allocator.num_free == prefill.allocator.num_pages
        assert alloc.num_free == alloc.num_pages
    finally:
        driver.close()
        prefill.shutdown()
        decode.instance.shutdown()
