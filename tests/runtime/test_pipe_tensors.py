"""runtime/pipe_tensors.py: a tensor crosses a real pipe as bytes and comes back bit for bit."""

import multiprocessing as mp

import pytest
import torch

from pdserve.runtime.pipe_tensors import from_pipe, to_pipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5), (7,)])
def test_a_tensor_comes_back_bit_for_bit_through_a_pipe(dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    a, b = mp.get_context("spawn").Pipe()
    a.send(to_pipe(t.t() if t.dim() == 2 else t))  # a non-contiguous view travels too
    back = from_pipe(b.recv())
    want = t.t() if t.dim() == 2 else t
    assert back.dtype == dtype and back.shape == want.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
    back += 1  # the instance may change it in place (penalties): it owns its bytes
