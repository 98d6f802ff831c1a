"""The import graph of pdserve/ (docs/design.md section 2), read from the source with `ast`: every
import statement, at module level or inside a function, counts.

  - transfer/ is a leaf under the servers: it imports nothing from prefill_server/ or decode_server/;
  - no package-level cycles: the graph of pdserve's subpackages (an edge A -> B when a module of A
    imports one of B) has no cycle;
  - no module-level cycles inside a package: among the modules of one package, the imports (again
    every one, inside functions too: a function-level import only hides a cycle, it does not remove
    it) form no cycle;
  - no module is reachable only from tests: every module is imported, directly or not, from an entry
    point (the `pdserve` command, `python -m pdserve.cli.docs_flags`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pdserve"
ENTRY_POINTS = ("pdserve.cli", "pdserve.cli.__main__", "pdserve.cli.docs_flags")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The pdserve modules one file imports (a `from pkg import name` of a submodule counts it)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in modules}


def graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: _imports(p, set(files)) for m, p in files.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_transfer_imports_no_server():
    bad = {
        (m, i)
        for m, deps in graph().items()
        if m.startswith("pdserve.transfer")
        for i in deps
        if i.startswith(("pdserve.prefill_server", "pdserve.decode_server"))
    }
    assert not bad, f"transfer/ imports a server: {sorted(bad)}"


def test_transfer_speaks_no_server_vocabulary():
    """The hand-off machines report outcomes; turning them into a server's events (Token, Finished,
    Failed) or asking a rank group is the servers' orchestration (decode_server/handoff_rooms.py)."""
    bad = {
        (m, i)
        for m, deps in graph().items()
        if m.startswith("pdserve.transfer")
        for i in deps
        if i in ("pdserve.serving.instance_loop", "pdserve.runtime.launcher")
    }
    assert not bad, f"transfer/ uses the servers' events or rank groups: {sorted(bad)}"


def test_no_package_level_cycles():
    edges: dict[str, set[str]] = {}
    for m, deps in graph().items():
        edges.setdefault(_package(m), set()).update(_package(d) for d in deps if _package(d) != _package(m))
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(pkg: str, path: list[str]) -> None:
        state[pkg] = 1
        for dep in sorted(edges.get(pkg, ())):
            assert state.get(dep) != 1, f"package cycle: {' -> '.join(path + [pkg, dep])}"
            if dep not in state:
                visit(dep, path + [pkg])
        state[pkg] = 2

    for pkg in sorted(edges):
        if pkg not in state:
            visit(pkg, [])
    assert (
        "pdserve.transfer" in edges["pdserve.prefill_server"]
    )  # the graph was read: servers import transfer


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph `edges`, as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [node, dep] if dep in path else path + [node, dep]
            if dep not in state and (found := visit(dep, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_find_cycle_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_cycles_inside_a_package():
    g = graph()
    packages = {m.rpartition(".")[0] for m in g if m.count(".") >= 2}
    assert {"pdserve.prefill_server", "pdserve.decode_server", "pdserve.transfer"} <= packages
    for pkg in sorted(packages):
        inside = {m for m in g if m.rpartition(".")[0] == pkg}
        edges = {m: {d for d in g[m] if d in inside and d != m} for m in inside}
        cycle = _find_cycle(edges)
        assert cycle is None, f"import cycle inside {pkg}: {' -> '.join(cycle)}"


def test_every_module_is_reachable_from_an_entry_point():
    g = graph()
    seen, todo = set(), list(ENTRY_POINTS)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a module runs its packages
        todo += sorted(g.get(m, ()))
    unreachable = sorted(set(g) - seen)
    assert not unreachable, f"modules reachable only from tests (or not at all): {unreachable}"


def test_the_router_imports_no_torch_module():
    """Every module of router/ (and what it imports, at module level) loads without torch: the
    router's image and process stay small, and nothing there can touch a tensor."""
    import subprocess
    import sys

    routers = sorted(m for m in graph() if m == "pdserve.router" or m.startswith("pdserve.router."))
    assert len(routers) > 20  # the graph was read
    code = (
        "import importlib, sys\n"
        f"for m in {routers!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", f"the router imports torch: {out.stdout.strip()[:300]}"
