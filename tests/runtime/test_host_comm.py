"""The `host` comm (runtime/comm.HostComm: copy to host, the CPU collectives, copy back), the comm of
several ranks on one GPU, in two real rank processes: every collective equals gloo's, through the
shared-memory path and through a slot too small for the payload (gloo inside). On CPU the copies
are no-ops, so this checks the wrapping and the in-place all_reduce contract; tests/gpu runs the
same on CUDA tensors. The flat collectives of torch 2.11 (all_gather_into_tensor,
reduce_scatter_tensor: the GPU machine has no *_single) give the *_single results on gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.runtime.comm import GlooComm, HostComm, ShmComm, make_comm
from tests.reference import free_port
from tests.runtime.test_comm import _check


def _worker(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        gloo = GlooComm(rank, 2)
        for slot in (1 << 20, 256):  # shared memory; too small a slot (gloo under the host comm)
            host = HostComm(ShmComm(rank, 2, slot_bytes=slot), torch.device("cpu"))
            for call, shape in enumerate([(4, 5), (2, 40)]):
                _check(host, gloo, rank, 2, 10 * call, shape)
            x = torch.full((3,), float(rank + 1), dtype=torch.float64)
            assert host.all_reduce(x) is x and x.tolist() == [3.0] * 3  # in place, like the others
            host.close()
        x = torch.arange(6, dtype=torch.float64) + 10 * rank
        a, b = torch.empty(12, dtype=torch.float64), torch.empty(12, dtype=torch.float64)
        dist.all_gather_single(a, x)
        dist.all_gather_into_tensor(b, x)
        assert torch.equal(a, b)
        a, b = torch.empty(3, dtype=torch.float64), torch.empty(3, dtype=torch.float64)
        dist.reduce_scatter_single(a, x)
        dist.reduce_scatter_tensor(b, x)
        assert torch.equal(a, b)
        assert make_comm("auto", rank, 2, device_comm="nccl").__class__ is GlooComm
        results.put((rank, "ok"))
    except Exception as e:  # reported, not swallowed: the test fails with it
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_host_comm_equals_gloo():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_worker, args=(free_port(), results), nprocs=2, start_method="spawn")
    got = sorted(results.get(timeout=5) for _ in range(2))
    assert got == [(0, "ok"), (1, "ok")]


def test_one_rank_needs_no_copies_and_no_process_group():
    """A single GPU rank gets the plain comm (nothing crosses ranks, nothing is copied to the host),
    and its collectives work without a process group."""
    comm = make_comm("auto", 0, 1, device_comm="host")
    assert type(comm) is GlooComm
    x = torch.arange(6.0).view(1, 2, 3)
    assert torch.equal(comm.all_to_all(x), x) and torch.equal(comm.reduce_scatter(x), x[0])
    assert torch.equal(comm.all_gather(x[0]), x) and comm.all_reduce(x) is x
