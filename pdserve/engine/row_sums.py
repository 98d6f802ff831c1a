"""Row sums: per row of a tensor, the wrapping int64 sum of its bytes, read as words of the widest
integer type that divides the row's byte size (so a row's sum depends on its bytes only, not on
where it sits). bench/transfer_raw.py verifies its raw pairs with them; hand-offs no longer do:
their room MAC runs over keyed row hashes (transfer/row_mac.py), which a changed row cannot keep,
as it could keep its sum."""

from __future__ import annotations

import torch

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """[n] int64 on the rows' device (a GPU sums VRAM rows there): one sum per row of [n, ...]."""
    b = rows.reshape(len(rows), -1).contiguous().view(torch.uint8)
    if b.numel() == 0:
        return torch.zeros(len(b), dtype=torch.int64, device=b.device)
    size, word = next((n, t) for n, t in _WORDS if b.shape[1] % n == 0)
    if b.storage_offset() % size or b.data_ptr() % size:
        b = b.clone()  # a view at an odd offset: word loads need alignment
    return b.view(word).sum(1, dtype=torch.int64)
