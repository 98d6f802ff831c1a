"""decode_server/vocab_tp.py: in real gloo rank processes, with an uneven split (11 rows over 3 ranks:
3, 4, 4), a vocab-parallel lookup equals the replicated one bit for bit, and the gathered logits equal
the replicated head's to the last bits in float64 (model/layers.linear picks its BLAS path by the
weight's shape, so a narrower slice may sum a dot product in another order)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.decode_server.vocab_tp import VocabParallelEmbedding, VocabParallelHead
from pdserve.model.shard import cut_rows
from pdserve.model.transformer import Embedding
from pdserve.runtime.comm import GlooComm
from pdserve.runtime.tp_shard import span
from tests.reference import free_port

VOCAB, HIDDEN, WORLD = 11, 6, 3


def _full() -> Embedding:
    emb = Embedding(VOCAB, HIDDEN)
    emb.weight.data = torch.randn(
        VOCAB, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(7)
    )
    return emb


def _worker(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        comm = GlooComm(rank, WORLD)
        rows = span(VOCAB, rank, WORLD)
        emb, head = _full(), _full()
        cut_rows(emb, rows)
        cut_rows(head, rows)
        assert (emb.cut.start, emb.cut.stop, emb.cut.full) == (rows.start, rows.stop, VOCAB)
        ids = torch.tensor([0, 2, 3, 6, 7, 10, 3, 3])  # each rank's first and last row, repeated ids
        hidden = torch.randn(4, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        got = VocabParallelEmbedding(emb, rows, comm)(ids)
        logits = VocabParallelHead(head, VOCAB, WORLD, comm).logits(hidden)
        results.put((rank, got.tolist(), logits.tolist()))  # floats: exact, and no shared storage
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_lookup_and_logits_equal_the_replicated_ones():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(free_port(), results), nprocs=WORLD, start_method="spawn")
    got = sorted((results.get(timeout=30) for _ in range(WORLD)), key=lambda r: r[0])
    full = _full()
    ids = torch.tensor([0, 2, 3, 6, 7, 10, 3, 3])
    hidden = torch.randn(4, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert [r for r, _, _ in got] == list(range(WORLD))
    for rank, rows, logits in got:
        assert torch.equal(torch.tensor(rows, dtype=torch.float64), full(ids)), rank
        torch.testing.assert_close(
            torch.tensor(logits, dtype=torch.float64), full.logits(hidden), rtol=0, atol=1e-14
        )
