"""forbid_host_sync(): fail fast on torch calls that make the host wait for the device.

Code meant to be captured in a CUDA graph (the fused MoE, a decode step) must never read a value
of a device tensor on the host: `.item()`, `.tolist()`, `bool(t)` / `if t:`, `int(t)`, `float(t)`,
`torch.equal`, and the ops whose output shape depends on values (nonzero, boolean-mask indexing
and writes, masked_select, unique, repeat_interleave with tensor repeats, bincount, which reads
max().item() on CUDA, ...). On the GPU `torch.cuda.set_sync_debug_mode("error")` catches them where
they run; this catches them on the CPU too, where nothing would ever wait, so CPU tests can prove a
code path sync-free:

    with forbid_host_sync():
        moe_align(topk_ids, n_experts, 16)   # raises HostSyncError if any such op runs

A decode rank runs its step under it when its config asks (`DecodeWorkerConfig.forbid_host_sync`,
tests only: tests/decode_server/test_no_sync.py).

It is a TorchDispatchMode (every aten op passes through it, on any device) plus a patch of
Tensor.tolist, which reads the data without dispatching an op. What it sees is the aten op and its
arguments: a sync hidden inside another op's C++ kernel is caught by the list below only when the
op is listed (bincount, unique, ...). Tensor.tolist is patched process-wide while the context is
open: use it in tests and checks, not in a multi-threaded server. Code that must touch host
memory inside a checked region without a device behind it (the shared-memory collectives'
flags) reads it through numpy, which torch's dispatcher never sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSyncError(RuntimeError):
    """A torch call would wait for the device (see forbid_host_sync)."""


# ops that read device values on the host, or whose output shape depends on values
_SYNCING = {
    "aten::_local_scalar_dense": "reads a value on the host (.item(), int(t), float(t), bool(t), if t:)",
    "aten::item": "reads a value on the host (.item())",
    "aten::is_nonzero": "reads a value on the host (bool(t), if t:)",
    "aten::equal": "returns a Python bool (torch.equal)",
    "aten::nonzero": "output shape depends on values (nonzero, argwhere, boolean masks)",
    "aten::masked_select": "output shape depends on values (masked_select)",
    "aten::bincount": "output shape depends on values (bincount reads max().item())",
    "aten::_unique": "output shape depends on values (unique)",
    "aten::_unique2": "output shape depends on values (unique)",
    "aten::unique_dim": "output shape depends on values (unique)",
    "aten::unique_consecutive": "output shape depends on values (unique_consecutive)",
    "aten::unique_dim_consecutive": "output shape depends on values (unique_consecutive)",
    "aten::histc": "reads min / max on the host when no range is given",
    "aten::tensor_split.tensor_indices_or_sections": "reads split points on the host",
}
_SYNCING_OVERLOADS = {
    "aten::repeat_interleave.Tensor": "output shape depends on values (repeat_interleave, tensor repeats)",
    "aten::repeat_interleave.self_Tensor": "output shape depends on values (repeat_interleave, tensor repeats)",
}
_BOOL_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _overload_name(func) -> str:
    packet = func.overloadpacket._qualified_op_name  # "aten::index"
    return packet if func._overloadname == "default" else f"{packet}.{func._overloadname}"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _device_to_host(func, args, kwargs) -> bool:
    """A copy from an accelerator into CPU memory that the host must wait for."""
    name = func.overloadpacket._qualified_op_name
    if name == "aten::_to_copy":
        src, dst = args[0], kwargs.get("device")
        return src.device.type != "cpu" and dst is not None and torch.device(dst).type == "cpu"
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return blocking and dst.device.type == "cpu" and src.device.type != "cpu"
    return False


def why_sync(func, args, kwargs) -> str | None:
    """Why this aten call syncs with the device, or None."""
    packet = func.overloadpacket._qualified_op_name
    if packet in _SYNCING:
        return _SYNCING[packet]
    name = _overload_name(func)
    if name in _SYNCING_OVERLOADS:
        return _SYNCING_OVERLOADS[name]
    if packet in _BOOL_INDEXED and _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
        return "indexing with a boolean mask (its output shape depends on values)"
    if _device_to_host(func, args, kwargs):
        return "a blocking copy from the device to the host"
    return None


class _ForbidSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = why_sync(func, args, kwargs)
        if why is not None:
            raise HostSyncError(f"{_overload_name(func)}: {why}")
        return func(*args, **kwargs)


def _tolist(self, *args, **kwargs):
    raise HostSyncError("Tensor.tolist: reads every value on the host")


@contextlib.contextmanager
def forbid_host_sync() -> Iterator[None]:
    """Raise HostSyncError on any torch call inside that would sync the host with the device."""
    had = "tolist" in torch.Tensor.__dict__
    saved = torch.Tensor.__dict__.get("tolist")
    torch.Tensor.tolist = _tolist
    try:
        with _ForbidSync():
            yield
    finally:
        if had:
            torch.Tensor.tolist = saved
        else:
            del torch.Tensor.tolist
