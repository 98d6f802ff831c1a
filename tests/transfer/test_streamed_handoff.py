"""The streamed hand-off (prefill_server/handoff_stream.py): rows leave as each layer stores them.

Exactness is checked wherever hand-offs run, since production instances stream by default: the
TCP and NIXL hand-off tests, the prefix-cache hand-offs and the randomized shape sweep (tests/sweep,
chunk sizes 5, 16 and 4096). Here, between real rank processes:
  - a prefill rank killed right after it posted the rows of half the layers (its room's first and
    only chunk): rows had landed on the decode ranks though the prefill never finished (they
    left per layer), the room fails on both sides, over NIXL the decode side holds the room's pages
    (the surviving rank's WRITEs may still land there) until their quarantine ends, nothing stays
    held on either side after it, and the decode instance then serves a hand-off exactly;
  - a streamed send whose payload is corrupted after its room MAC fails the room by checksum;
  - the unstreamed path (prefill, then send) gives the decode ranks the same rows.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.model.config import ModelConfig
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.faults import KILL_AT_LAYER_ENV
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import free_port
from tests.transfer.handoff_driver import Driver, FaultySource, TransferError, hand_off
from tests.transfer.handoff_helpers import assert_decode_idle, assert_idle, prompt

pytestmark = pytest.mark.slow


def stored_frames(decode) -> int:
    return sum(s.counters["stored_frames"] for s in decode.instance.transfer_status("none"))


@pytest.mark.parametrize("transfer", ["tcp", "nixl"])
def test_a_rank_killed_after_half_the_layers_leaks_nothing(
    instances, model_path, single, transfer, monkeypatch
):
    decode = instances.get_decode(2, 2, "copy", transfer)
    room, layers = f"half-{transfer}", ModelConfig.from_pretrained(model_path).num_layers
    # rank 0: the plan of this prompt has it send in layers 0..L/2-1 (rank 1's first rows come later,
    # and a rank blocked in a collective makes no progress on WRITEs it posted)
    monkeypatch.setenv(KILL_AT_LAYER_ENV, f"{room}:{layers // 2 - 1}:0")  # read by the ranks it starts
    w = PrefillWorkerConfig(
        model_path,
        num_slots=512,
        dtype="float64",
        query_block=16,
        float32_islands=False,
        transfer=transfer,
    )
    prefill = PrefillInstance(w, LaunchConfig(2, free_port())).start()
    monkeypatch.delenv(KILL_AT_LAYER_ENV)
    before, driver = stored_frames(decode), Driver(prefill, decode)
    try:
        with pytest.raises(TransferError, match="RankError"):
            driver.hand_off(prompt(23), SamplingParams(max_tokens=1), room=room)
        if transfer == "nixl":  # the surviving rank's WRITEs may still land: the pages stay held
            assert decode.instance.allocator.num_held > 0, "pages freed while a sender may still write"
    finally:
        driver.close()
        prefill.shutdown()
    counters = [s.counters for s in decode.instance.transfer_status("none")]
    assert sum(c["stored_frames"] for c in counters) > before, (
        f"no row arrived before the prefill died: {counters}"
    )
    assert not prefill.held and prefill.allocator.num_free == prefill.allocator.num_pages
    assert_decode_idle(decode)
    ids, params = prompt(23), SamplingParams(max_tokens=8, ignore_eos=True)
    req = hand_off(instances.get_prefill(2, "full", transfer), decode, ids, params)
    decode.run_until_idle()
    assert req.output_ids == single.generate([ids], [params])[0]


def test_a_corrupted_streamed_payload_fails_the_room(instances):
    prefill, decode = instances.get_prefill(2, "full"), instances.get_decode(2, 2, "copy")
    source = FaultySource(prefill, corrupt=True, stream_handoff=True)
    with pytest.raises(TransferError, match="checksum mismatch"):
        hand_off(prefill, decode, prompt(23), SamplingParams(max_tokens=1), source=source)
    assert_idle(prefill, decode)


def test_streamed_and_unstreamed_rows_are_equal(instances):
    prefill, decode = instances.get_prefill(2, "full"), instances.get_decode(2, 2, "copy")
    ids, dumps = prompt(23), []
    for stream in (True, False):
        source = FaultySource(prefill, stream_handoff=stream)
        req = hand_off(prefill, decode, ids, SamplingParams(max_tokens=4), source=source)
        dumps.append(decode.instance.dump(decode.instance.slots(req.pages, len(ids))))
        decode.run_until_idle()
    for a, b in zip(*dumps):  # each rank's rows in position order (the pages may differ)
        assert len(a.slots) == len(b.slots) and a.kv.keys() == b.kv.keys()
        for layer in a.kv:
            assert torch.equal(a.kv[layer], b.kv[layer]), layer
        for layer in a.index:
            assert torch.equal(a.index[layer], b.index[layer]), layer
    assert_idle(prefill, decode)
