"""bench/transfer_raw.py, the hand-off's ceilings: every pair's bytes land where the receiver reads
them, and the verified round reads each landed byte (its row sums add up to the senders' bytes)."""

import pytest
import torch


@pytest.fixture
def raw(bench_module):
    """bench/transfer_raw.py imported as a bench script imports it: the spawned processes unpickle
    their functions from `transfer_raw` on the path they inherit."""
    return bench_module("transfer_raw")


def sender_bytes(total: int) -> torch.Tensor:
    return (torch.arange(total, dtype=torch.int64) % 251).to(torch.uint8)  # _sender's pattern


def test_verified_rounds_read_exactly_what_each_pair_wrote(raw):
    row = 640
    tail = 96  # a pair's bytes need not be whole rows (index rows are narrower): read as one more row
    pairs = {(0, 0): 64 * row + tail, (1, 0): 32 * row, (1, 1): 128 * row}  # sender 1 feeds both
    rp = raw.RawPairs(pairs, row)
    try:
        assert rp.nbytes == sum(pairs.values())
        assert rp.round(False) > 0 and rp.sums == {0: None, 1: None}
        assert rp.round(True) > 0
        # sender s WRITEs its targets from consecutive bytes of its pattern, in receiver order
        s1 = sender_bytes(32 * row + 128 * row)
        s0 = sender_bytes(64 * row + tail)
        expected = {
            0: raw.row_sums(s0[: 64 * row].view(-1, row)).sum()
            + raw.row_sums(s0[64 * row :].view(1, -1)).sum()
            + raw.row_sums(s1[: 32 * row].view(-1, row)).sum(),
            1: raw.row_sums(s1[32 * row :].view(-1, row)).sum(),
        }
        assert rp.sums == {d: int(v) for d, v in expected.items()}
        assert rp.sums[0] != rp.sums[1]
        # chunked: WRITEs of at most 10 rows (the odd bytes rounded down to whole rows), each read as
        # it is notified -- every byte still read once, none twice
        assert rp.round(True, chunk_bytes=10 * row + 7) > 0
        wrap = 1 << 64  # a receiver adds its chunks' (wrapping int64) sums as Python ints
        assert {d: v % wrap for d, v in rp.sums.items()} == {d: int(v) % wrap for d, v in expected.items()}
    finally:
        rp.close()


def test_pieces_cover_a_pair_once_in_chunks(raw):
    assert raw.pieces(100, 25, 0) == [(100, 25)]
    assert raw.pieces(100, 25, 10) == [(100, 10), (110, 10), (120, 5)]
    assert raw.pieces(0, 20, 10) == [(0, 10), (10, 10)]
    # a notification's tag is never the prefix of another's (NIXL matches by prefix)
    tags = [raw.piece_tag(b"raw1", off) for off in (1, 10, 100)]
    assert not any(a != b and b.startswith(a) for a in tags for b in tags)
