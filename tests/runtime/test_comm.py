"""runtime/comm.py: shared-memory collectives give exactly gloo's results, in real rank processes.

Three ranks run every collective over the whole world and over the sub-group {0, 1}, in float64
with different data per rank and per call, through the shared segment and through gloo, and
compare bit for bit; reductions must also be bitwise identical on every rank. Payloads larger than
a slot take the gloo path. A thousand back-to-back calls with changing data exercise the two
alternating buffers (a rank overwriting a buffer another still reads would change a result).
A missing peer makes the wait time out with the ranks named; no segment file is left behind.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.runtime.comm import GlooComm, ShmComm, make_comm
from tests.reference import free_port


def _data(rank: int, call: int, shape) -> torch.Tensor:
    return torch.randn(
        *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * call + rank)
    )


def _check(shm, gloo, rank, size, call, shape) -> None:
    x = _data(rank, call, shape)
    send = _data(rank, call + 1, (size,) + shape)
    assert torch.equal(shm.all_gather(x), gloo.all_gather(x))
    assert torch.equal(shm.all_gather(x)[rank], x)
    got = shm.all_reduce(x.clone())
    want = sum(_data(r, call, shape) for r in range(size))
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.equal(gloo.all_gather(got), got.expand((size,) + shape)), "ranks disagree on the sum"
    assert torch.equal(shm.all_to_all(send), gloo.all_to_all(send))
    assert torch.equal(
        shm.all_to_all(send), torch.stack([_data(r, call + 1, (size,) + shape)[rank] for r in range(size)])
    )
    assert torch.allclose(shm.reduce_scatter(send), gloo.reduce_scatter(send), rtol=0, atol=1e-12)


def _worker(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        sub = dist.new_group([0, 1])
        world = (ShmComm(rank, 3), GlooComm(rank, 3), 3)
        tiny = (
            ShmComm(rank, 3, slot_bytes=256),
            GlooComm(rank, 3),
            3,
        )  # [4, 5] float64 = 160 B; [2, 40] does not fit
        comms = [world, tiny]
        if rank < 2:
            comms.append((ShmComm(rank, 2, sub), GlooComm(rank, 2, sub), 2))
        for shm, gloo, size in comms:
            for call, shape in enumerate([(4, 5), (2, 40), (1, 3, 7)]):
                _check(shm, gloo, rank, size, 10 * call, shape)
        shm = world[0]
        for call in range(1000):  # back to back, changing data: the double buffer must hold
            x = torch.full((8,), float(call * 10 + rank), dtype=torch.float64)
            assert shm.all_reduce(x.clone())[0].item() == 30 * call + 3, call
        if rank < 2:  # rank 1 sets this one up but never calls it: rank 0 must give up, naming rank 1
            lonely = ShmComm(rank, 2, sub, timeout_s=0.5)
            if rank == 0:
                try:
                    lonely.all_gather(torch.zeros(3))
                    results.put((rank, "no timeout", []))
                except TimeoutError as e:
                    results.put((rank, str(e), []))
            lonely.close()
        for shm, _, _ in comms:
            shm.close()
        assert make_comm("gloo", rank, 3).__class__ is GlooComm
        paths = [shm.path for shm, _, _ in comms] + ([lonely.path] if rank < 2 else [])
        results.put((rank, "ok", paths))
    finally:
        dist.destroy_process_group()


def test_shared_memory_collectives_equal_gloo():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(free_port(), results), nprocs=3, start_method="spawn")
    got = sorted(results.get(timeout=5) for _ in range(4))
    assert [r for r, msg, _ in got if msg == "ok"] == [0, 1, 2]
    timeout_msgs = [msg for r, msg, _ in got if msg != "ok"]
    assert len(timeout_msgs) == 1 and "ranks [1] did not arrive" in timeout_msgs[0], timeout_msgs
    segments = {path for _, _, paths in got for path in paths}
    assert len(segments) == 4 and all(p.startswith("/dev/shm/pdserve-comm-") for p in segments), segments
    assert not [p for p in segments if os.path.exists(p)], "a segment file was left in /dev/shm"
    assert os.path.isdir("/dev/shm")
