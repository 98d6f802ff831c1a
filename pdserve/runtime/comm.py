"""Collectives of a fixed group of rank processes: gloo, or shared memory for ranks on one host.

gloo on loopback TCP takes 350-750 us per collective even for a few KB (measured on the 2-core CI
machine), where a GPU's NVLink takes ~8 us (article section 3.6). A decode step makes 2-4 small
collectives per layer, so on CPU gloo's latency, not the work, decided the step time. `ShmComm`
does the same collectives through one shared-memory segment per group (what vLLM's and SGLang's
CPU backends do for their all-reduce):

  segment   flags[size] (one int64 per rank, 64 bytes apart) | 2 buffers x size slots x slot_bytes
  call n    every rank copies its input into its slot of buffer n % 2, then sets flags[rank] = n;
            waits until every flag >= n; reads what it needs from the other slots.
Two buffers suffice: a rank writes buffer n % 2 only after passing call n - 1's wait, and every
rank raised its flag to n - 1 only after it had finished reading call n - 2 (the same buffer).
Ordering relies on x86's total store order (the data copy is stored before the flag, and loads
are not reordered with loads); on other CPUs `make_comm` falls back to gloo.

Results are identical on every rank: reductions add the ranks' contributions in rank order.
A payload larger than a slot goes through gloo instead. Waiting spins briefly, then yields the
core (ranks may outnumber cores), and gives up after `timeout_s`: a dead peer is otherwise the
launcher's watchdog's business.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid

import torch
import torch.distributed as dist

from ..choices import CpuComm, values

CPU_COMMS = values(CpuComm)
# torch >= 2.12 names them *_single; older builds (the GPU machine's 2.11) only have the *_tensor forms
ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_LINE = 64  # bytes between two ranks' flags: one cache line each


class GlooComm:
    """torch.distributed collectives of `group` (None: the whole world): gloo on CPU tensors, NCCL
    on CUDA tensors when the group has it (runtime/device.py)."""

    def __init__(self, rank: int, size: int, group=None):
        self.rank, self.size, self.group = rank, size, group

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x on each rank -> [size, *x.shape] in rank order."""
        if self.size == 1:
            return x.unsqueeze(0)
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        ALL_GATHER_FLAT(out, x.contiguous(), group=self.group)
        return out.view((self.size,) + tuple(x.shape))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (x is overwritten with it and returned)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """send [size, ...]: part j goes to rank j -> recv [size, ...]: part j came from rank j."""
        if self.size == 1:
            return send.clone()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        return recv

    def reduce_scatter(self, send: torch.Tensor) -> torch.Tensor:
        """send [size, ...]: part j is this rank's contribution to rank j -> the sum of my parts."""
        if self.size == 1:
            return send[0].clone()
        recv = send.new_empty(tuple(send.shape[1:]))
        flat = send.contiguous().view((-1,) + tuple(send.shape[2:]))  # [size * n, ...]: gloo's layout
        REDUCE_SCATTER_FLAT(recv, flat, group=self.group)
        return recv

    def close(self) -> None:
        pass


class ShmComm(GlooComm):
    """Same collectives through shared memory; `group` (gloo) sets it up and carries what does not fit."""

    def __init__(self, rank: int, size: int, group=None, slot_bytes: int = 1 << 20, timeout_s: float = 600.0):
        super().__init__(rank, size, group)
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        header = size * _LINE
        total = header + 2 * size * slot_bytes
        name = [f"/dev/shm/pdserve-comm-{uuid.uuid4().hex}" if rank == 0 else None]
        dist.broadcast_object_list(
            name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group
        )
        self.path = name[0]  # unlinked once every rank mapped it
        if rank == 0:
            with open(name[0], "wb") as f:
                f.truncate(total)
        dist.barrier(group=group)
        with open(name[0], "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), total)
        dist.barrier(group=group)  # every rank mapped it: the name can go, the mapping stays
        if rank == 0:
            os.unlink(name[0])
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._flags = raw[:header].view(torch.int64)[:: _LINE // 8]  # [size]
        # read through numpy while waiting: no torch op per spin, and none a host-sync check sees
        # (a decode step calls the collectives inside runtime/sync_check.forbid_host_sync in tests)
        self._flags_np = self._flags.numpy()
        self._bufs = raw[header:].view(2, size, slot_bytes)
        self._calls = 0

    def _exchange(self, x: torch.Tensor) -> torch.Tensor | None:
        """Publishes x; returns every rank's bytes [size, nbytes] once all published (None: too big)."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            return None
        self._calls += 1
        n = self._calls
        buf = self._bufs[n % 2]
        buf[self.rank, :nbytes].copy_(x.contiguous().view(-1).view(torch.uint8))
        self._flags[self.rank] = n
        self._wait(n)
        return buf[:, :nbytes]

    def _wait(self, n: int) -> None:
        flags, spins, start = self._flags_np, 0, None
        while flags.min() < n:
            spins += 1
            if spins < 200:
                continue
            os.sched_yield()
            if start is None:
                start = time.monotonic()
            elif spins % 1024 == 0 and time.monotonic() - start > self.timeout_s:
                raise TimeoutError(
                    f"shared-memory collective {n}: ranks {(flags < n).nonzero()[0].tolist()} "
                    f"did not arrive within {self.timeout_s:.0f} s"
                )

    def _view(self, data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return data.view(like.dtype).view((self.size,) + tuple(like.shape))

    def all_gather(self, x):
        if self.size == 1:
            return x.unsqueeze(0)
        data = self._exchange(x)
        return super().all_gather(x) if data is None else self._view(data, x).clone()

    def all_reduce(self, x):
        if self.size == 1:
            return x
        data = self._exchange(x)
        if data is None:
            return super().all_reduce(x)
        parts = self._view(data, x)
        x.copy_(_ordered_sum(parts))
        return x

    def all_to_all(self, send):
        data = self._exchange(send)
        if data is None:
            return super().all_to_all(send)
        return self._view(data, send)[:, self.rank].clone()

    def reduce_scatter(self, send):
        data = self._exchange(send)
        if data is None:
            return super().reduce_scatter(send)
        return _ordered_sum(self._view(data, send)[:, self.rank])

    def close(self) -> None:
        self._flags = self._flags_np = self._bufs = None
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view: the mapping goes with the process
            pass


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts[0] + parts[1] + ... in that order: the same bits on every rank."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


class HostComm:
    """Collectives of CUDA tensors through host memory, for several ranks on one GPU (NCCL refuses
    them): copy to host, the CPU comm `inner`, copy back to `device`."""

    def __init__(self, inner, device: torch.device):
        self.inner, self.device = inner, device
        self.rank, self.size = inner.rank, inner.size

    def _back(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, non_blocking=False)

    def all_gather(self, x):
        return self._back(self.inner.all_gather(x.cpu()))

    def all_reduce(self, x):
        x.copy_(self.inner.all_reduce(x.cpu().clone()))
        return x

    def all_to_all(self, send):
        return self._back(self.inner.all_to_all(send.cpu()))

    def reduce_scatter(self, send):
        return self._back(self.inner.reduce_scatter(send.cpu()))

    def close(self) -> None:
        self.inner.close()


def make_comm(kind: str, rank: int, size: int, group=None, device_comm: str = "cpu"):
    """`auto` is shared memory on x86 (every rank of an instance runs on its host), else gloo.

    device_comm (DevicePlan.comm): "cpu" as above; "nccl" torch.distributed on the ranks' GPUs;
    "host" the CPU comm `kind` wrapped in HostComm (ranks sharing a GPU, or a single GPU rank)."""
    if kind not in CPU_COMMS:
        raise ValueError(f"--cpu-comm must be one of {', '.join(CPU_COMMS)}, got {kind!r}")
    if device_comm == "nccl" or (device_comm == "host" and size == 1):  # one rank: nothing crosses
        return GlooComm(rank, size, group)
    if device_comm == "host":
        return HostComm(make_comm(kind, rank, size, group), torch.device("cuda", torch.cuda.current_device()))
    if kind == "auto":
        kind = "shm" if platform.machine() in ("x86_64", "AMD64") else "gloo"
    if kind == "shm" and size > 1:
        return ShmComm(rank, size, group)
    return GlooComm(rank, size, group)
