"""docs/architecture.md has a row for every module of pdserve/: a module added without one (or a
row left for a module that is gone) fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def sections(text: str) -> dict[str, str]:
    """## heading -> its text."""
    parts = re.split(r"^## ", text, flags=re.M)
    return {p.split("\n", 1)[0]: p for p in parts[1:]}


def documented(module: Path, text: str, by_heading: dict[str, str]) -> bool:
    rel = module.relative_to(ROOT).as_posix()
    if rel in text:
        return True
    package = module.parent.relative_to(ROOT).as_posix()  # e.g. pdserve/engine
    return any(
        heading.split()[0] == package and f"`{module.name}`" in body for heading, body in by_heading.items()
    )


def test_every_module_has_a_row():
    text = DOC.read_text()
    by_heading = sections(text)
    modules = [p for p in (ROOT / "pdserve").rglob("*.py") if p.name != "__init__.py"]
    missing = sorted(p.relative_to(ROOT).as_posix() for p in modules if not documented(p, text, by_heading))
    assert not missing, f"docs/architecture.md has no row for {missing}"


def test_every_row_names_a_module_that_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`(pdserve/[\w/]+\.py)`", text))
    gone = sorted(n for n in named if not (ROOT / n).exists())
    assert not gone, f"docs/architecture.md names modules that no longer exist: {gone}"
