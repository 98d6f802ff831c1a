"""Where an instance's ranks run: `--device cpu|cuda`, `--gpu-ids`, and what follows from them.

On cuda, rank r of an instance uses GPU gpu_ids[r] (default r): the launcher calls
torch.cuda.set_device before the process group exists. Ranks on distinct GPUs talk over NCCL (the
process group is "cpu:gloo,cuda:nccl", so CPU-side control tensors keep working); several ranks on
one GPU (NCCL refuses that) use the `host` comm: copy to host memory, the shared-memory
collectives of runtime/comm.py, copy back. A configuration that cannot run is a startup error that
names the problem (docs/design.md: no silent fallback), checked by `check_devices` before any rank
starts and again inside each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import check_attention_ops, check_device, check_device_fields, default_dtype, parse_gpu_ids  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class DevicePlan:
    """What check_devices decided for the ranks of one node of an instance (all of them on one host)."""

    device: str  # "cpu" | "cuda"
    gpus: tuple[int, ...]  # per local rank (empty on cpu); every node the same
    nodes: int = 1  # hosts the instance spans (NCCL between them; the host comm never crosses one)

    @property
    def shared_gpu(self) -> bool:
        """Several ranks on one GPU: NCCL cannot run them, the host comm does."""
        return len(set(self.gpus)) < len(self.gpus)

    @property
    def dist_backend(self) -> str:
        if self.device == "cuda" and not self.shared_gpu and len(self.gpus) * self.nodes > 1:
            return "cpu:gloo,cuda:nccl"
        return "gloo"

    @property
    def comm(self) -> str:
        """The collectives the workers use (runtime/comm.py make_comm's device side)."""
        if self.device == "cpu":
            return "cpu"
        return "host" if self.shared_gpu or len(self.gpus) * self.nodes == 1 else "nccl"


def check_devices(
    device: str,
    world_size: int,
    gpu_ids: tuple[int, ...] = (),
    cuda_count: int | None = None,
    nodes: int = 1,
) -> DevicePlan:
    """Validates --device / --gpu-ids for `world_size` ranks on this host (of an instance over
    `nodes` hosts, each running as many); raises ValueError saying what is wrong.

    cuda_count: visible GPUs (None: ask torch). Several ranks may share a GPU only when --gpu-ids
    says so explicitly (the default maps local rank r to GPU r and needs world_size GPUs)."""
    if check_device(device) == "cpu":
        if gpu_ids:
            raise ValueError("--gpu-ids needs --device cuda")
        return DevicePlan("cpu", (), nodes)
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_count == 0:
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__})")
    if gpu_ids and len(gpu_ids) != world_size:
        raise ValueError(f"--gpu-ids lists {len(gpu_ids)} GPU(s) for {world_size} rank(s): give one per rank")
    gpus = gpu_ids or tuple(range(world_size))
    missing = sorted({g for g in gpus if g >= cuda_count})
    if missing:
        raise ValueError(
            f"--device cuda: {world_size} rank(s) need GPU(s) {list(gpus)} but only {cuda_count} "
            f"{'is' if cuda_count == 1 else 'are'} visible (ordinals {missing} are missing)"
        )
    if nodes > 1 and len(set(gpus)) < len(gpus):
        raise ValueError(
            "--nnodes > 1: NCCL joins the nodes, so every rank needs a GPU of its own (--gpu-ids)"
        )
    return DevicePlan("cuda", gpus, nodes)


def rank_device(device: str) -> torch.device:
    """This process's device: the GPU the launcher selected (set_device), or the CPU."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup_rank_device(plan: DevicePlan, rank: int) -> None:
    """Called in rank processes before the process group exists."""
    if plan.device == "cuda":
        torch.cuda.set_device(plan.gpus[rank])
