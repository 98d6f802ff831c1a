"""NCCL: one rank per process (one GPU each), the process group the launcher builds for
--device cuda with distinct GPUs ("cpu:gloo,cuda:nccl"), and one all-gather through it. With a
single GPU the group has one rank (NCCL refuses two ranks on one GPU: that case is the host comm's)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tests.reference import free_port


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from pdserve.runtime.comm import make_comm
    from pdserve.runtime.device import check_devices, setup_rank_device

    plan = check_devices("cuda", world, tuple(range(world)))
    setup_rank_device(plan, rank)
    backend = "cpu:gloo,cuda:nccl" if world > 1 else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        comm = make_comm("gloo", rank, world, device_comm="nccl")
        x = torch.full((4,), float(rank + 1), device="cuda")
        got = comm.all_gather(x).cpu()
        ok = got.tolist() == [[float(r + 1)] * 4 for r in range(world)]
        results.put((rank, "ok" if ok else f"all_gather gave {got.tolist()}"))
    except Exception as e:
        results.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_nccl_all_gather_one_rank_per_gpu():
    world = min(2, torch.cuda.device_count())
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank, args=(world, free_port(), results), nprocs=world, start_method="spawn")
    got = sorted(results.get(timeout=60) for _ in range(world))
    assert got == [(r, "ok") for r in range(world)]
