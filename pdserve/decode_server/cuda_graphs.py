"""--cuda-graphs: a decode rank replays its step from one CUDA graph per step shape.

A decode step is hundreds of small kernels; launching them one by one from Python costs more than
running them at small batches. The step is free of host syncs (runtime/sync_check.py) and its
inputs sit in fixed buffers per (batch bucket, page-width bucket) (decode_server/step_metadata.py),
so the whole forward -- model, DCP attention and merge, KV writes, logits -- can be captured once
per shape and replayed. The first step of a shape runs eagerly (that is its answer, and the warm-up:
lazy tables, cuBLAS handles) and is then captured; every later step of that shape is one replay.
All graphs share one memory pool. Every rank captures at the same steps (they run the same
commands), so NCCL collectives are captured in lockstep.

What cannot be captured is refused (`graph_blocker`): the CPU; the flashinfer attention ops (they
plan on the host each step); ranks that exchange through host memory (several ranks on one GPU:
runtime/comm.py HostComm copies to the host inside the step). `--cuda-graphs on` with a blocker is
a startup error; the default (on for --device cuda) turns graphs off with a line saying why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import torch


def graph_blocker(device: str, world: int, device_comm: str, attention_ops: str) -> str | None:
    """Why this rank cannot capture its step, or None."""
    if device != "cuda":
        return f"CUDA graphs need --device cuda (device is {device})"
    if attention_ops == "flashinfer":
        return "the flashinfer attention ops plan on the host every step (use --attention-ops torch)"
    if world > 1 and device_comm != "nccl":
        return "ranks sharing a GPU exchange through host memory inside the step"
    return None


def use_graphs(requested: str, blocker: str | None, who: str) -> bool:
    """requested: on | off | auto (the default on cuda: on where it can run, printed)."""
    if requested == "off":
        return False
    if blocker is None:
        print(
            f"{who}: cuda graphs on (one per step shape, captured on first use)", file=sys.stderr, flush=True
        )
        return True
    if requested == "on":
        raise ValueError(f"--cuda-graphs on cannot run: {blocker}")
    print(f"{who}: cuda graphs off ({blocker})", file=sys.stderr, flush=True)
    return False


class CudaCapture:
    """Records `forward` into a CUDA graph in a memory pool shared by every graph of the rank."""

    def __init__(self):
        self.pool = None

    def __call__(self, forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a receiver thread storing hand-off rows meanwhile is not part of the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = forward()  # recorded, not run: its output tensor lives in the pool
        self.pool = graph.pool()
        return graph.replay, out


class StepGraphs:
    """One graph per key, captured lazily. `capture(forward)` -> (replay, output tensor); the CUDA
    one by default, any callable in CPU tests of this bookkeeping."""

    def __init__(self, capture: Callable | None = None):
        self.capture = capture or CudaCapture()
        self._graphs: dict[Hashable, tuple[Callable[[], None], torch.Tensor]] = {}

    @property
    def keys(self) -> list:
        return list(self._graphs)

    def run(self, key: Hashable, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The step's output: a replay when `key` was captured, else an eager run, then the capture.
        A replay's output is overwritten by the next replay of the same key: read it first."""
        if key in self._graphs:
            replay, out = self._graphs[key]
            replay()
            return out
        out = forward()
        self._graphs[key] = self.capture(forward)
        return out
