"""A decode step's inputs as fixed-shape tensors on the rank's device, and what the step derives
from them there.

A step needs, per request, its newest token, its position and where its context lies. The host
packs them into one int32 array per step, [B, 3 + W]: token id, position, length, then the
request's page table (W pages; pages past the request's last are 0, never read), and copies it to
the device once (pinned, non-blocking on cuda). Everything else -- each context position's global
slot, which positions are read, the new token's slot -- is derived on the device by `derive_slots`
and the attention backend, so the step itself never reads a value on the host (runtime/sync_check.py)
and can be replayed as a CUDA graph (decode_server/cuda_graphs.py).

Buckets. With `pad` (CUDA graphs: one graph per shape) a batch of n requests takes the smallest
batch bucket B >= n among 1, 2, 4, ... up to --max-batch, and its page tables the smallest width
bucket W (a power of two, at most `max_pages`) that holds its longest request; each (B, W) bucket
keeps its host and device buffers for good. The width is bucketed too because the torch attention
ops read all W * page_size positions of every row (masked): one width of max_pages would make every
step as slow as the longest context allows. Rows n..B-1 are padding: token 0 at position 0 with
length 0, so they read no key, and the backend writes their new entry into the pool's scratch row
(kvcache/kv_cache.py), never into a slot; their outputs are dropped. Without `pad` (the eager step on
the CPU) B = n and W = the batch's own most pages: no row or position is computed for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

HEAD = 3  # columns before the page table: token id, position, length


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_batch, then max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds n (past the last one: n rounded up to a power of two)."""
    for b in buckets:
        if b >= n:
            return b
    return 1 << (n - 1).bit_length()


def width_of(pages: int, max_pages: int) -> int:
    """The page-table width bucket of a batch whose longest request has `pages` pages."""
    return min(1 << max(pages - 1, 0).bit_length(), max(max_pages, pages))


@dataclass(frozen=True)
class StepInputs:
    """One step's inputs on the device (views of one packed [B, 3 + W] int32 tensor)."""

    token_ids: torch.Tensor  # [B] the newest token of each request (0: padding)
    positions: torch.Tensor  # [B] its position, length - 1 (0: padding)
    lengths: torch.Tensor  # [B] context length S: positions 0..S-1 are read (0: padding)
    page_table: torch.Tensor  # [B, W] pages of each request (0 past its last page)
    page_size: int
    rows: int  # real requests: rows 0..rows-1; the rest is padding

    @property
    def key(self) -> tuple[int, int]:
        """(batch bucket, width bucket): what a CUDA graph is captured for."""
        return tuple(self.page_table.shape)


def derive_slots(page_table: torch.Tensor, lengths: torch.Tensor, page_size: int):
    """(slots [B, W * P] int64: the global slot of every position of every row, valid [B, W * P]:
    the positions a row reads, pos < length) -- device ops of static shape only."""
    width = page_table.shape[1] * page_size
    pos = torch.arange(width, dtype=torch.int64, device=page_table.device)
    slots = page_table.long().repeat_interleave(page_size, dim=1) * page_size + pos % page_size
    return slots, pos[None, :] < lengths.long()[:, None]


class StepMetadata:
    """Packs a step's host lists into its bucket's buffers; one host -> device copy per step."""

    def __init__(self, device: torch.device, page_size: int, max_pages: int, max_batch: int, pad: bool):
        self.device, self.page_size, self.max_pages, self.pad = device, page_size, max_pages, pad
        self.buckets = batch_buckets(max_batch)
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, object]] = {}

    def shape(self, n: int, most_pages: int) -> tuple[int, int]:
        if not self.pad:
            return n, max(most_pages, 1)
        return bucket_of(n, self.buckets), width_of(most_pages, self.max_pages)

    def _buffer(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(host [B, 3 + W], device [B, 3 + W], the event of the last copy out of host or None)."""
        if key not in self._buffers:
            cuda = self.device.type == "cuda"
            host = torch.zeros(key[0], HEAD + key[1], dtype=torch.int32, pin_memory=cuda)
            dev = torch.zeros(key[0], HEAD + key[1], dtype=torch.int32, device=self.device)
            self._buffers[key] = (host, dev, torch.cuda.Event() if cuda else None)
        return self._buffers[key]

    def fill(self, token_ids: list[int], pages: list[list[int]], lengths: list[int]) -> StepInputs:
        n = len(token_ids)
        if not n == len(pages) == len(lengths):
            raise ValueError(f"a step of {n} tokens with {len(pages)} page lists and {len(lengths)} lengths")
        most = max(-(-s // self.page_size) for s in lengths)
        key = self.shape(n, most)
        if self.pad:
            host, dev, copied = self._buffer(key)
            if copied is not None:
                copied.synchronize()  # the previous step's copy has left the pinned buffer
        else:
            host = torch.empty(key[0], HEAD + key[1], dtype=torch.int32)
            dev, copied = None, None
        packed = host.numpy()  # filled without a torch op per request
        packed[:] = 0
        packed[:n, 0] = token_ids
        packed[:n, 1] = np.asarray(lengths) - 1
        packed[:n, 2] = lengths
        for i, (p, s) in enumerate(zip(pages, lengths)):
            need = -(-s // self.page_size)
            if len(p) < need:
                raise ValueError(
                    f"request {i}: {s} tokens need {need} pages of {self.page_size}, it has {len(p)}"
                )
            packed[i, HEAD : HEAD + need] = p[:need]
        if dev is None:
            dev = host.to(self.device)
        else:
            dev.copy_(host, non_blocking=True)
            if copied is not None:
                copied.record()
        return StepInputs(dev[:, 0], dev[:, 1], dev[:, 2], dev[:, HEAD:], self.page_size, n)
