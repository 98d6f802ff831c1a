"""The native few-row product (native/rows.c): float32 x [M <= 8, K] times W [N, K]^T on the CPU,
built with the machine's C compiler at first use and called through ctypes.

Why: a decode step's products have one row per request, so each is a read of W and little else,
and its speed is the rate W is read at. The kernels torch ships do not read at the memory's rate
for this shape. Cold W on this AMD EPYC VM (2 threads, `python bench/engine.py` has the step-level
effect), reading rates in GB/s:

    W (N x K)      MKL (W x^T)^T   oneDNN   plain sum of W   this kernel
    512 x 512            12          13            33             32
    2048 x 2048          14          21-29         41-44          30-41
    4096 x 2048          15          32-33         44-48          41-44

Torch's own sum reading the same matrix is the yardstick: this kernel streams each thread's block
of W once, in order, as a sum does. Inputs are checked by `usable`; anything else (float64, other
devices, more rows, an odd layout) keeps torch's kernels, and so does a machine where the kernel
cannot be built (no C compiler, a CPU without AVX2 and FMA, a torch without libgomp):
`status()` says which, and the servers print it at startup. PDSERVE_NATIVE=0 turns it off.

The shared library lives in ~/.cache/pdserve/native (or $PDSERVE_CACHE/native), keyed by the
source, the flags, the compiler and the OpenMP runtime it links: torch's own libgomp, so the
kernel's threads are torch's threads (torch.set_num_threads applies to it too).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native") / "rows.c"
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC"]
MAX_ROWS = 8  # rows.c MAX_ROWS
_P = ctypes.c_void_p
_I = ctypes.c_int64
# rows.c's entry points: (x, its strides, w, its strides, [bias,] y, its strides, sizes, threads)
_SIGNATURES = {
    "pd_heads_linear": [_P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int],
    "pd_heads_axpy": [_P, _I, _I, _P, _I, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int],
}

_state: dict = {}  # "lib": the bound library or None, "status": why


def _cache_dir() -> Path:
    base = os.environ.get("PDSERVE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "pdserve") / "native"


def _torch_gomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's), from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    return sorted(paths)[0] if len(paths) == 1 else None


def _compile(cc: str, gomp: str, out: Path) -> str | None:
    """Builds the library at `out` (atomically: concurrent ranks each build and rename); an error or None."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "rows.o", Path(tmp) / out.name
        steps = (
            [cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            # linked against torch's libgomp by path, not -lgomp: one OpenMP runtime in the process
            [cc, "-shared", str(obj), gomp, "-o", str(lib)],
        )
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"{cc} failed: {e}"
            if r.returncode:
                tail = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
                return f"{cc} failed: {tail}"
        os.replace(lib, out)
    return None


def _load() -> tuple[object | None, str]:
    if os.environ.get("PDSERVE_NATIVE", "1") == "0":
        return None, "off (PDSERVE_NATIVE=0)"
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX2", "AVX512"):
        return None, f"unavailable: this CPU's capability is {cap}; the kernel needs AVX2 and FMA"
    gomp = _torch_gomp()
    if gomp is None:
        return None, "unavailable: torch's OpenMP runtime (one libgomp) is not loaded"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "unavailable: no C compiler (cc) on PATH"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"unavailable: {cc} --version failed: {e}"
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), " ".join(COMPILE_FLAGS).encode(), version.encode(), gomp.encode()])
    ).hexdigest()[:16]
    out = _cache_dir() / f"rows-{key}.so"
    if not out.is_file() and (err := _compile(cc, gomp, out)):
        return None, f"unavailable: {err}"
    lib = ctypes.CDLL(str(out))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib, f"native few-row kernels ({out})"


def _lib():
    if "status" not in _state:
        _state["lib"], _state["status"] = _load()
    return _state["lib"]


def status() -> str:
    """What few-row float32 CPU products run on, and why (built on first call)."""
    _lib()
    return _state["status"]


def _floats(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad for t in ts)


def usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether x [M, K] (M <= MAX_ROWS) times w [N, K]^T (+ b [N]) can take the kernel: float32 CPU
    tensors whose rows are contiguous, and the kernel built."""
    return (
        x.dim() == 2
        and w.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[1]
        and x.stride(1) == 1
        and w.stride(1) == 1
        and _floats(x, w)
        and (b is None or (_floats(b) and b.is_contiguous() and b.shape == w.shape[:1]))
        and _lib() is not None
    )


def heads_usable(x: torch.Tensor, w: torch.Tensor, contract: int) -> bool:
    """Whether x [M, H, D] (M <= MAX_ROWS) and w [H, a, b] can take a heads kernel: x's dim 2 and
    w's dim `contract` (2: heads_linear, 1: heads_axpy) of one size, float32 CPU tensors with
    contiguous last dims, and the kernels built."""
    return (
        x.dim() == 3
        and w.dim() == 3
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[0]
        and x.shape[2] == w.shape[contract]
        and x.stride(2) == 1
        and w.stride(2) == 1
        and _floats(x, w)
        and _lib() is not None
    )


def _out(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """The kernel's output, on x's device (the CPU) whatever torch's default device is: the kernel
    writes through its pointer."""
    return torch.empty(*shape, dtype=torch.float32, device=x.device)


def _call(name: str, *args) -> None:
    if getattr(_state["lib"], name)(*args, torch.get_num_threads()):
        raise MemoryError(f"the native kernel {name} could not allocate its packed rows")


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) -> [M, N] by the kernel (one head of `heads_linear`, without its views: a decode
    step makes this call some hundred times); the caller checked `usable`."""
    (M, K), N = x.shape, w.shape[0]
    y = _out(x, M, N)
    bias = b.data_ptr() if b is not None else None
    _call("pd_heads_linear", x.data_ptr(), x.stride(0), 0, w.data_ptr(), w.stride(0), 0, bias,
          y.data_ptr(), N, 0, M, 1, N, K)  # fmt: skip
    return y


def heads_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, H, K], w [H, N, K] (+ b [N]) -> y [M, H, N], y[m, h] = w[h] x[m, h] (+ b); the caller
    checked `heads_usable(x, w, 2)` (and the bias, as `usable` does)."""
    (M, H, K), N = x.shape, w.shape[1]
    y = _out(x, M, H, N)
    xs, ws = x.stride(), w.stride()
    bias = b.data_ptr() if b is not None else None
    _call("pd_heads_linear", *(x.data_ptr(), xs[0], xs[1]), *(w.data_ptr(), ws[1], ws[0]), bias,
          *(y.data_ptr(), H * N, N), M, H, N, K)  # fmt: skip
    return y


def heads_axpy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, H, N], w [H, N, C] -> y [M, H, C], y[m, h] = x[m, h] w[h]; the caller checked
    `heads_usable(x, w, 1)`."""
    (M, H, N), C = x.shape, w.shape[2]
    y = _out(x, M, H, C)
    xs, ws = x.stride(), w.stride()
    _call("pd_heads_axpy", *(x.data_ptr(), xs[0], xs[1]), *(w.data_ptr(), ws[1], ws[0]),
          *(y.data_ptr(), H * C, C), M, H, N, C)  # fmt: skip
    return y
