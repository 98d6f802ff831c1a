"""Collectives over rows when each rank holds a different number of rows (uneven token splits).

Gathers and reduce-scatters pad rows to the largest count so that one fixed-size collective carries
them all; `all_to_all_rows` sends each rank its own number of rows with torch's uneven
`all_to_all_single` (gloo on CPU tensors, NCCL on CUDA ones). CUDA tensors in a gloo group (ranks
sharing a GPU, runtime/device.py) travel through host memory.
"""

from __future__ import annotations

from functools import partial

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


def all_to_all_rows(
    x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None
) -> torch.Tensor:
    """x [sum(send_counts), ...]: rows laid out by destination rank (send_counts[j] rows to rank j)
    -> [sum(recv_counts), ...]: recv_counts[j] rows from rank j, rank by rank. A count may be 0."""
    if len(send_counts) == 1:
        return x
    out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
    op = partial(dist.all_to_all_single, output_split_sizes=recv_counts, input_split_sizes=send_counts)
    _through_host(op, out, x.contiguous(), group)
    return out


def exchange_counts(send_counts: torch.Tensor, group=None) -> list[int]:
    """send_counts [size] (int64: what this rank sends each rank) -> what each rank sends this one."""
    if send_counts.numel() == 1:
        return send_counts.tolist()
    out = torch.empty_like(send_counts)
    _through_host(dist.all_to_all_single, out, send_counts.contiguous(), group)
    return out.tolist()


def _through_host(op, out: torch.Tensor, x: torch.Tensor, group) -> None:
    """op(out, x) in the group; CUDA tensors are staged on the host when the group has no NCCL."""
    if not x.is_cuda or "nccl" in str(dist.get_backend(group)):
        op(out, x, group=group)
        return
    host = out.cpu()
    op(host, x.cpu(), group=group)
    out.copy_(host)
