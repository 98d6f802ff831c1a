"""Room-MAC row hashes a prefill pool keeps as it stores its rows (KVPool.keep_row_hashes), read by
a NIXL sender for the rows it WRITEs straight from the pool (docs/nixl.md)."""

import threading

import torch

from pdserve.model.config import ModelConfig
from pdserve.transfer.plan import plan_transfer
from pdserve.transfer.rank_commands import merge_checksums
from tests.transfer.test_data_path import _filled_pool, _one_nixl_room, layout


def test_rows_sent_from_the_pool_are_not_hashed_again_by_the_sender(model_path, monkeypatch):
    """A NIXL sender turns on its pool's row hashes (KVPool.keep_row_hashes), taken as rows are
    stored, and reads them for the rows it WRITEs from the pool: while it sends, only the receivers
    (their own threads) hash rows, and the room MACs agree."""
    from pdserve.transfer import base

    cfg = ModelConfig.from_pretrained(model_path)
    src = _filled_pool(cfg)
    prefill, decode = layout(cfg, "dcp2")
    plan = plan_transfer(prefill, decode, 300)
    hashed_on, real = [], base.row_macs
    monkeypatch.setattr(base, "row_macs", lambda *a: hashed_on.append(threading.current_thread()) or real(*a))
    reply, status, _ = _one_nixl_room(cfg, src, plan, decode, "test-kept")
    sums = merge_checksums([reply])
    assert all(status[r].error is None and status[r].checksum == sums[r] for r in status)
    assert src.hasher is not None and hashed_on and threading.main_thread() not in hashed_on


def test_a_row_changed_behind_the_pools_back_fails_the_room_mac(model_path):
    """A row changed in a prefill pool other than through its writes keeps the hash stored with it:
    the receiver hashes the bytes that landed, so that decode rank's room MAC disagrees with the
    sender's (the hand-off fails rather than deliver a row the model never stored); the others agree."""
    cfg = ModelConfig.from_pretrained(model_path)
    src = _filled_pool(cfg)
    prefill, decode = layout(cfg, "dcp2")
    plan = plan_transfer(prefill, decode, 300)
    t = next(t for t in plan if t.kind == "kv" and t.dst_rank == 1)

    def change() -> None:  # after the sender turned the pool's row hashes on
        src.kv[src.kv_row[t.layer], src.kv_row_ids(torch.tensor([t.runs[0].src]))] += 1.0

    reply, status, _ = _one_nixl_room(cfg, src, plan, decode, "test-stale", before_send=change)
    sums = merge_checksums([reply])
    assert status[1].complete and status[1].checksum != sums[1]
    assert status[0].checksum == sums[0]
