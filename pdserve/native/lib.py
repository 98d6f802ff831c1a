"""The shared library of native/ops.py's kernels (native/rows.c, moe.c, attend.c, rowhash.c): built with the
machine's C compiler at first use, loaded and called through ctypes.

The shared library lives in ~/.cache/pdserve/native (or $PDSERVE_CACHE/native), keyed by the
source, the flags, the compiler and the OpenMP runtime it links: torch's own libgomp, so the
kernel's threads are torch's threads (torch.set_num_threads applies to it too).
A machine where it cannot be built (no C compiler, a CPU without AVX2 and FMA, a torch without
libgomp, PDSERVE_NATIVE=0) gets None from `_lib()` and the reason from `status()`. So does one whose
cache directory or library another user could write (not owned by this user, or group / world
writable): a library loaded from there would run whatever that user put in it.
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

from .. import env

SOURCES = [Path(__file__).parent / name for name in ("rows.c", "moe.c", "attend.c", "rowhash.c")]
HEADERS = [Path(__file__).parent / "rows.h"]  # part of the key, like the sources
COMPILE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC"]
MAX_ROWS = 8  # rows.h MAX_ROWS
# The entry points' argument types, one letter each: P pointer, I int64, f float, i int (the last,
# every time: the thread count)
_TYPES = {"P": ctypes.c_void_p, "I": ctypes.c_int64, "f": ctypes.c_float, "i": ctypes.c_int}
_SIGNATURES = {
    # rows.c: (x, its strides, w, its strides, [bias,] y, its strides, sizes, threads)
    "pd_heads_linear": "PIIPIIPPIIIIIIi",
    "pd_heads_axpy": "PIIPIIPIIIIIIi",
    # (x, its row stride, w, y, its row stride, M, N, eps, threads)
    "pd_rms_norm": "PIPPIIIfi",
    # moe.c: (x, its row stride, gate_up, its strides, down, its strides, expert ids [M, k], weights
    # [M, k], M, k, E, H, I, y, its row stride, threads)
    "pd_moe_rows": "PIPIIPIIPPIIIIIPIi",
    # (x, its row stride, w, its row stride, bias, E, H, n_group, topk_group, k, norm, scaling, M, ids,
    # weights, threads)
    "pd_route_rows": "PIPIPIIIIIifIPPi",
    # attend.c: (q, its strides, keys, theirs, row ids or NULL, table rows, valid, its strides, out, lse,
    # B, H, S, D, dv, scale, threads)
    "pd_attend": "PIIPIIPIPIIPPIIIIIfi",
    # (q, its strides, w, its row stride, keys, theirs, out, B, H, S, D, scale, threads)
    "pd_index_scores": "PIIPIPIIPIIIIfi",
    # (scores, row stride, valid, its strides, B, S, k, out, threads)
    "pd_topk_earliest": "PIPIIIIIPi",
    # rowhash.c: (byte rows, their row stride in bytes, n, bytes per row, uint32 key words, uint64 out
    # [n, 2], threads)
    "pd_row_hash": "PIIIPPi",
}
_CPU = torch.device("cpu")
_state: dict = {}  # "lib": the bound library or None, "status": why


def _cache_dir() -> Path:
    base = env.CACHE.text()
    return (Path(base) if base else Path.home() / ".cache" / "pdserve") / "native"


def _torch_gomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's), from /proc/self/maps."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    return sorted(paths)[0] if len(paths) == 1 else None


def _untrusted(path: Path) -> str | None:
    """Why a library at or under `path` could be another user's, or None."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def _compile(cc: str, gomp: str, out: Path) -> str | None:
    """Builds the library at `out` (atomically: concurrent ranks each build and rename); an error or None."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, lib = [Path(tmp) / f"{src.stem}.o" for src in SOURCES], Path(tmp) / out.name
        steps = (
            *([cc, *COMPILE_FLAGS, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)),
            # linked against torch's libgomp by path, not -lgomp: one OpenMP runtime in the process
            [cc, "-shared", *map(str, objs), gomp, "-lm", "-o", str(lib)],
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
    if not env.NATIVE.on():
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
        b"\0".join(
            [
                *(src.read_bytes() for src in SOURCES + HEADERS),
                " ".join(COMPILE_FLAGS).encode(),
                version.encode(),
                gomp.encode(),
            ]
        )
    ).hexdigest()[:16]
    cache = _cache_dir()
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = cache / f"rows-{key}.so"
    if why := _untrusted(cache):
        return None, f"unavailable: {why}"
    if not out.is_file() and (err := _compile(cc, gomp, out)):
        return None, f"unavailable: {err}"
    if why := _untrusted(out):
        return None, f"unavailable: {why}"
    lib = ctypes.CDLL(str(out))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [_TYPES[c] for c in argtypes], ctypes.c_int
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
    for t in ts:  # a loop of cheap attributes: this runs before every kernel call of a decode step
        if t.dtype != torch.float32 or not t.is_cpu or t.requires_grad:
            return False
    return True


def _out(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """The kernel's output, on x's device (the CPU) whatever torch's default device is: the kernel
    writes through its pointer."""
    return torch.empty(*shape, dtype=torch.float32, device=_CPU)


def _call(name: str, *args) -> None:
    if err := getattr(_lib(), name)(*args, torch.get_num_threads()):
        if err == -1:
            raise MemoryError(f"the native kernel {name} could not allocate its scratch")
        if err == -3:
            raise IndexError(f"the native kernel {name} was given a row outside its table")
        raise ValueError(f"the native kernel {name} refused its arguments ({err})")
