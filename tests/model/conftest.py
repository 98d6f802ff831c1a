"""Fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch

from pdserve.native import ops as native


@pytest.fixture
def native_calls(monkeypatch) -> list[str]:
    """The names of the native kernels called (through native._call) while the test runs."""
    calls, call = [], native._call

    def spy(name, *args):
        calls.append(name)
        return call(name, *args)

    monkeypatch.setattr(native, "_call", spy)
    return calls


@pytest.fixture
def assert_thread_count_free():
    """assert_thread_count_free(fn): fn() -> tuple of tensors gives the same bits at 1 and 2 threads."""

    def check(fn) -> None:
        before, outs = torch.get_num_threads(), []
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(fn())
        finally:
            torch.set_num_threads(before)
        assert len(outs[0]) == len(outs[1]) > 0
        for a, b in zip(*outs):
            assert torch.equal(a, b)

    return check


@pytest.fixture(scope="module")
def kern():
    """The triton kernels under triton's CPU interpreter (tests/model/triton_interp.py; imported only
    when a test asks for it, so the other model tests run where triton is missing)."""
    from tests.model.triton_interp import interpreted_kernels

    yield from interpreted_kernels()
