"""Host tensors on transparent huge pages: the KV pools and the raw-transfer buffers of bench/.

A hand-off over UCX shared memory is a kernel copy (process_vm_writev) that pins every page of
both ends; with 4 KiB pages a 44 MB WRITE pins ~11k pages on each side, with 2 MiB pages 22. The
pool is allocated 2 MiB-aligned, advised MADV_HUGEPAGE before its first touch, then zeroed, so the
kernel backs it with huge pages where it can (THP "madvise" or "always"; with "never", or when
the kernel has none free, it falls back to small pages and nothing else changes). GPU tensors and
small ones are plain torch.zeros.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE = 2 << 20  # x86-64 / arm64 transparent huge page size
MADV_HUGEPAGE = 14
_libc = None


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return bool(_libc) and _libc.madvise(addr, length, MADV_HUGEPAGE) == 0


def zeros(*shape: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """torch.zeros(*shape, dtype=dtype, device=device), on huge pages when on the host and at least
    one huge page long. The tensor views a buffer up to 2 MiB longer (its alignment slack)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE:
        return torch.zeros(*shape, dtype=dtype, device=device)
    buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE
    base = buf.data_ptr() + start
    _madvise(base, (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
    return buf[start : start + nbytes].view(dtype).view(*shape).zero_()


def huge_page_bytes(t: torch.Tensor) -> int:
    """Bytes of huge pages in the mappings t lies in (/proc/self/smaps), for the tests: 0 where THP
    is off or the kernel had none."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total
