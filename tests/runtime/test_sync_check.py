"""runtime/sync_check.py: every op that would make the host wait for the device raises inside
forbid_host_sync (on the CPU, where nothing waits), and the ops a sync-free step is made of pass."""

from __future__ import annotations

import pytest
import torch

from pdserve.runtime.sync_check import HostSyncError, forbid_host_sync, why_sync


def _masked_write(t):
    t[t > 1] = 0


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t[0].item(),
        lambda t: t.tolist(),
        lambda t: bool(t[0]),
        lambda t: int(t[0]),
        lambda t: float(t[0]),
        lambda t: t.nonzero(),
        lambda t: torch.argwhere(t),
        lambda t: t[t > 1],
        _masked_write,
        lambda t: t.masked_select(t > 1),
        lambda t: torch.equal(t, t),
        lambda t: torch.unique(t),
        lambda t: torch.bincount(t),
        lambda t: t.repeat_interleave(t),
    ],
    ids=[
        "item", "tolist", "bool", "int", "float", "nonzero", "argwhere", "mask", "masked_write",
        "masked_select", "equal", "unique", "bincount", "repeat_interleave",
    ],
)  # fmt: skip
def test_forbid_host_sync_rejects(call):
    t = torch.tensor([3, 0, 2])
    with pytest.raises(HostSyncError), forbid_host_sync():
        call(t)
    assert t.tolist() == [3, 0, 2]  # Tensor.tolist is itself again, and the write never happened


def test_forbid_host_sync_lets_static_ops_through():
    t = torch.tensor([3, 0, 2])
    with forbid_host_sync():
        out = (t + 1, t[torch.tensor([0, 2])], torch.sort(t, stable=True), t.repeat_interleave(2))
        out += (torch.where(t > 1, t, -1), torch.searchsorted(t.sort().values, t), t.cumsum(0))
        out += (t.masked_fill(t > 1, 7), t.index_select(0, torch.tensor([1])), t.gather(0, torch.tensor([2])))
        u = t.clone()
        u.index_copy_(0, torch.tensor([0]), torch.tensor([9]))
        u[torch.tensor([1])] = 5  # an integer index writes in place
    assert out[0].tolist() == [4, 1, 3] and out[7].tolist() == [7, 0, 7] and u.tolist() == [9, 5, 2]


def test_a_device_to_host_copy_is_a_sync():
    """What `.cpu()` of a device tensor dispatches; host -> host and host -> device are not."""
    src = torch.empty(2, device="meta")  # stands in for a device tensor: only its device is read
    to_copy = torch.ops.aten._to_copy.default
    assert "device to the host" in why_sync(to_copy, (src,), {"device": torch.device("cpu")})
    assert why_sync(to_copy, (torch.empty(2),), {"device": torch.device("cpu")}) is None
    assert why_sync(to_copy, (torch.empty(2),), {"device": torch.device("meta")}) is None
    copy = torch.ops.aten.copy_.default
    assert "device to the host" in why_sync(copy, (torch.empty(2), src), {})
    assert why_sync(copy, (torch.empty(2), src, True), {}) is None  # non_blocking
