"""Triton's CPU interpreter for the kernel tests (test_triton_kernels.py, test_triton_gemm.py): the
`kern` fixture sets TRITON_INTERPRET=1 and imports the kernel modules afresh (put back as they were
afterwards), with two defects of triton 3.6's interpreter patched for its duration (see
test_triton_kernels.py's docstring and test_interpreter_defects_still_need_the_patches)."""

from __future__ import annotations

import importlib
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
interp = pytest.importorskip("triton.runtime.interpreter")

KERNEL_MODULES = ("pdserve.model.triton_moe", "pdserve.model.triton_gemm")
BLOCK = (128, 128)
_ORIGINAL_DOT = interp.InterpreterBuilder.create_dot
_ORIGINAL_PATCH_TENSOR = interp._patch_lang_tensor


def _bf16_as_f32(h):
    if h.dtype.scalar != tl.bfloat16:
        return h
    return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _ORIGINAL_DOT(self, _bf16_as_f32(a), _bf16_as_f32(b), d, input_precision, max_num_imprecise_acc)


def _patch_lang_tensor(tensor, scope):
    _ORIGINAL_PATCH_TENSOR(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


def _dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


def interpreted_kernels():
    """The `kern` fixture's body (tests/model/conftest.py): the kernel modules imported under the
    interpreter, patched, as SimpleNamespace(moe, gemm, dot); everything put back afterwards."""
    saved = {name: sys.modules.pop(name, None) for name in KERNEL_MODULES}
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            mp.setattr(interp.InterpreterBuilder, "create_dot", _create_dot)
            mp.setattr(interp, "_patch_lang_tensor", _patch_lang_tensor)
            # the interpreter checks every int32 add / sub / mul of the kernels for overflow (40% of
            # its time); at these shapes no offset comes near 2^31 (no tensor here holds a million
            # elements), so the check cannot fire and is off. GLM-5's dims are compiled, not run.
            options = interp.interpreter_builder.options
            mp.setattr(interp.interpreter_builder, "options", replace(options, sanitize_overflow=False))
            moe, gemm = (importlib.import_module(name) for name in KERNEL_MODULES)
            yield SimpleNamespace(moe=moe, gemm=gemm, dot=triton.jit(_dot_kernel))
    finally:
        _restore(saved)


def _restore(saved: dict) -> None:
    """Put back the kernel modules as they were before a fixture or test re-imported them."""
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


SM90_SHARED_MAX = 232448  # bytes of shared memory one block may opt into on sm90 (227 KiB)


class CompileForSm90:
    """Stands in for a @triton.jit kernel: each launch compiles it for sm90, with the specialization
    the real launch would get (argument types, divisibility by 16, constexprs), down to ptxas's
    cubin, instead of running it."""

    def __init__(self, kernel, backend, target, compiled: list):
        from triton.runtime.jit import create_function_from_signature

        self.kernel, self.backend, self.target, self.compiled = kernel, backend, target, compiled
        self.binder = create_function_from_signature(kernel.signature, kernel.params, backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            from triton.compiler import ASTSource, compile

            bound, spec, opts = self.binder(*args, **kwargs)
            options, signature, constexprs, attrs = self.kernel._pack_args(
                self.backend, kwargs, bound, spec, opts
            )
            src = ASTSource(self.kernel, signature, constexprs, attrs)
            if src.hash() not in {h for h, _ in self.compiled}:
                out = compile(src, target=self.target, options=options.__dict__)
                self.compiled.append((src.hash(), out))

        return launch
