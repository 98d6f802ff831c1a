"""TCP data frames are bounded whatever the pool (issue 40 item 7: large frames were buffered before
their tag check): a transfer goes as frames of at most DATA_PAYLOAD_MAX bytes and DATA_RUNS_MAX runs
(`pieces`), so a receiver's largest message and its queue per connection no longer grow with its
pool, and a peer without the key that sends a larger message is cut off by ZMQ before any of it is
taken -- while keyed transfers go on. (Exactness of split transfers: test_data_path.py "tcp-pieces".)"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig
from pdserve.transfer.frames import DATA_FRAME_MAX, DATA_PAYLOAD_MAX, DATA_RUNS_MAX, seal_data
from pdserve.transfer.tcp import RECV_QUEUE, TcpReceiver, pieces


def flat(cut):
    """The (row, dst) pairs of pieces' runs, in order."""
    out = []
    for first, end, runs in cut:
        rows = [d + i for d, n in runs for i in range(n)]
        assert len(rows) == end - first
        out += rows
    return out


@pytest.mark.parametrize(
    "runs, row_bytes",
    [
        ([[0, 10]], DATA_PAYLOAD_MAX // 3),  # one run over four frames
        ([[i * 3, 2] for i in range(DATA_RUNS_MAX * 2 + 5)], 8),  # many short runs: cut by their count
        ([[100, 7], [0, 1], [50, 9]], DATA_PAYLOAD_MAX // 4),
        ([], 64),
    ],
)
def test_pieces_keep_every_row_in_order_within_both_bounds(runs, row_bytes):
    cut = pieces(runs, row_bytes)
    assert flat(cut) == [d + i for d, n in runs for i in range(n)]
    assert [c[0] for c in cut] == [0] + [c[1] for c in cut[:-1]]  # contiguous payload slices
    for first, end, piece_runs in cut:
        assert (end - first) * row_bytes <= max(DATA_PAYLOAD_MAX, row_bytes)
        assert len(piece_runs) <= DATA_RUNS_MAX


def test_a_receivers_limits_do_not_grow_with_its_pool(model_path):
    cfg = ModelConfig.from_pretrained(model_path)
    small, large = KVPool(cfg, 64, torch.float64), KVPool(cfg, 40_000, torch.float64)
    for pool in (small, large):
        recv = TcpReceiver(0, lambda pool=pool: pool)
        try:
            assert recv.sock.getsockopt(zmq.MAXMSGSIZE) == DATA_FRAME_MAX
            assert recv.sock.getsockopt(zmq.RCVHWM) == RECV_QUEUE
        finally:
            recv.close()
    assert large.kv[0].numel() * 8 > DATA_FRAME_MAX  # the old bound: one layer of the pool


def test_an_oversized_message_is_cut_off_before_it_is_taken(model_path):
    cfg = ModelConfig.from_pretrained(model_path)
    pool = KVPool(cfg, 64, torch.float64)
    recv = TcpReceiver(0, lambda: pool)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        push.connect(recv.endpoint)
        push.send_multipart([b"h" * 100, bytes(DATA_FRAME_MAX + 1), b"t" * 32])  # over the limit
        # within it (after a reconnect), signed, its header garbage: the receiver counts it apart
        header, payload = b"h" * 100, b"p" * 1000
        push.send_multipart([header, payload, seal_data(recv.key, header, payload)])
        deadline = time.monotonic() + 5
        while recv.bad_frames < 1:  # the receiver thread lives and takes the next message
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # messages arrive in order: had the first been taken, it would have counted (unauthenticated)
        # before the second did
        assert recv.unauthenticated == 0 and recv.frames == 0  # ZMQ dropped the first, untaken
        assert recv.live.problem() is None
    finally:
        push.close()
        ctx.term()
        recv.close()
