"""Collectives over rows when each rank holds a different number of rows (uneven token splits).

Rows are padded to the largest count so that one fixed-size collective carries them all. CUDA
tensors in a gloo group (ranks sharing a GPU, engine/device.py) travel through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import ALL_GATHER_FLAT, REDUCE_SCATTER_FLAT


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def all_gather_rows(x: torch.Tensor, counts: list[int], group=None) -> torch.Tensor:
    """x [counts[rank], ...] on each rank -> [sum(counts), ...]: rank 0's rows, then rank 1's, ..."""
    width = max(counts)
    if len(counts) == 1:
        return x
    out = x.new_empty((len(counts) * width,) + tuple(x.shape[1:]))
    _through_host(ALL_GATHER_FLAT, out, pad_rows(x, width), group)
    keep = torch.cat([torch.arange(r * width, r * width + c, device=x.device) for r, c in enumerate(counts)])
    return out[keep]


def reduce_scatter_rows(x: torch.Tensor, counts: list[int], rank: int, group=None) -> torch.Tensor:
    """x [sum(counts), ...] partial sums laid out rank by rank -> this rank's rows of the total."""
    if len(counts) == 1:
        return x
    width = max(counts)
    padded = x.new_zeros((len(counts) * width,) + tuple(x.shape[1:]))
    start = 0
    for r, c in enumerate(counts):
        padded[r * width : r * width + c] = x[start : start + c]
        start += c
    out = x.new_empty((width,) + tuple(x.shape[1:]))
    _through_host(REDUCE_SCATTER_FLAT, out, padded, group)
    return out[: counts[rank]]


def _through_host(op, out: torch.Tensor, x: torch.Tensor, group) -> None:
    """op(out, x) in the group; CUDA tensors are staged on the host when the group has no NCCL."""
    if not x.is_cuda or "nccl" in str(dist.get_backend(group)):
        op(out, x, group=group)
        return
    host = out.cpu()
    op(host, x.cpu(), group=group)
    out.copy_(host)
