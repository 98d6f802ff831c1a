"""tests/gpu runs on a GPU machine that reaches no package index: besides the stdlib and its image's
torch, numpy and triton, it has only what tests/gpu/fetch_wheels.sh carries (README, "GPU"). This
CPU test imports every tests/gpu module, and every pdserve / tests module it reaches through imports
at any depth (those inside functions too: the rank processes run them), in a fresh interpreter whose
first sys.meta_path finder refuses any other top-level module, as if it were missing there. The
third-party imports inside functions, which importing runs none of, are read from the source.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "tests" / "gpu"
FETCH = GPU / "fetch_wheels.sh"
FIX = "add it to tests/gpu/fetch_wheels.sh (BASE_WHEELS)"

# What the GPU image brings (torch 2.11 + CUDA 13, numpy, triton): the torch wheel's packages and its
# Requires-Dist (filelock, typing-extensions, setuptools, sympy, networkx, jinja2, fsspec, triton,
# the nvidia-* CUDA libraries), with their own dependencies (sympy: mpmath; jinja2: markupsafe).
DEVICE_IMAGE = {
    "torch",
    "torchgen",
    "functorch",
    "filelock",
    "typing_extensions",
    "setuptools",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "nvidia",  # the namespace of the nvidia-* wheels
    "triton",
    "numpy",
}
# in sys.stdlib_module_names of Python 3.11 (CI) but gone from the GPU machine's 3.12
REMOVED_IN_312 = {"asynchat", "asyncore", "distutils", "imp", "smtpd"}
# imported by pdserve only inside functions, for the runs that carry them: flashinfer (FI1_WHEELS'
# flashinfer-python, not installed on CPU CI; engine/attn_flashinfer.py) and the `nixl` meta package
# (not carried: transfer/nixl_agent.py falls back to nixl_cu13, NIXL_WHEELS' nixl-cu13)
OPTIONAL = {"flashinfer", "nixl"}

BOOTSTRAP = r"""
import importlib, json, sys, traceback
job = json.load(sys.stdin)
allowed, refused, failed = set(job["allowed"]), {}, {}

class Refuse:
    '''First on sys.meta_path: a module the GPU machine lacks is missing here too.'''
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in allowed:
            return None
        frame = sys._getframe(1)
        while frame.f_back and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        refused[name] = frame.f_globals.get("__name__")
        raise ModuleNotFoundError(f"No module named {name!r} on the GPU machine", name=name)

sys.meta_path.insert(0, Refuse())
for file, modules in job["targets"].items():
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as e:
            if type(e).__name__ == "Skipped":  # pytest.importorskip: the module skips itself
                continue
            name = getattr(e, "name", None)
            if name in refused:
                why = f"{name!r}, imported by {refused[name]}, is not on the GPU machine: {job['fix']}"
            else:
                why = "".join(traceback.format_exception_only(e)).strip()
            failed.setdefault(file, {}).setdefault(why, []).append(module)
print(json.dumps(failed))
"""


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@cache
def carried() -> dict[str, list[str]]:
    """fetch_wheels.sh's arrays: {"BASE": [canonical distribution names], "NIXL": [...], "FI1": ...}."""
    text = re.sub(r"(^|\s)#.*", "", FETCH.read_text())
    return {
        folder: [_canonical(re.match(r"[\w.-]+", req).group()) for req in shlex.split(body)]
        for folder, body in re.findall(r"^(\w+)_WHEELS=\(([^)]*)\)", text, re.M)
    }


@cache
def allowed() -> frozenset[str]:
    """Top-level modules importable on the GPU machine in the standard run (base + nixl carried)."""
    provides: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(_canonical(dist), set()).add(top)
    names = set(sys.stdlib_module_names) - REMOVED_IN_312 | DEVICE_IMAGE | {"pdserve", "tests"}
    names.add(sysconfig._get_sysconfigdata_name())  # the stdlib's, not listed in stdlib_module_names
    for dist in carried()["BASE"] + carried()["NIXL"]:
        assert dist in provides, f"{dist} (fetch_wheels.sh) is not installed here: its modules are unknown"
        names |= provides[dist]
    return frozenset(names | OPTIONAL)


def _source(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def reach(start: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """The pdserve / tests modules a file reaches through imports at any depth (itself first), and the
    other modules any of them imports: {(top-level name, "file:line")}."""
    todo, seen, others = [start], [], set()
    while todo:
        path = todo.pop()
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        if module in seen:
            continue
        seen.append(module)
        package = module.split(".")[: None if path.name == "__init__.py" else -1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in ("pdserve", "tests"):
                    others.add((top, f"{path.relative_to(REPO)}:{node.lineno}"))
                elif (source := _source(name)) is not None:
                    todo.append(source)
    return [seen[0], *sorted(seen[1:])], others


FILES = sorted(GPU.glob("*.py"))


@pytest.fixture(scope="module")
def refusals() -> dict[str, dict[str, list[str]]]:
    """{tests/gpu file name: {why: [modules whose import failed so]}}, from one interpreter."""
    job = {
        "allowed": sorted(allowed()),
        "fix": FIX,
        "targets": {path.name: reach(path)[0] for path in FILES},
    }
    out = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_gpu_module_imports_only_what_the_device_has(path, refusals):
    problems = [
        f"{why}\n    (importing {', '.join(mods)})" for why, mods in refusals.get(path.name, {}).items()
    ]
    reported = " ".join(problems)
    for name, where in sorted(reach(path)[1]):
        if name not in allowed() and repr(name) not in reported:
            problems.append(f"{name!r}, imported at {where}, is not on the GPU machine: {FIX}")
            reported += repr(name)
    assert not problems, f"tests/gpu/{path.name}:\n" + "\n".join(problems)


def test_fetch_wheels_lists_parse():
    lists = carried()
    assert {"BASE", "NIXL", "FI1", "FI2", "FI3"} <= set(lists)
    assert {"pytest", "llguidance", "pyzmq"} <= set(lists["BASE"])
    assert "flashinfer-python" in lists["FI1"]
