"""pdserve/env.py is the one place pdserve reads PDSERVE_* environment variables from: no other
module of pdserve/ names one as a string (help texts may mention them), each knob reads its value
one way, and a malformed value is an error naming the variable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdserve import env

ROOT = Path(__file__).resolve().parents[1] / "pdserve"
NAME = re.compile(r"PDSERVE_[A-Z0-9_]+")


def names_outside_env() -> list[str]:
    """`file:line: 'PDSERVE_X'` for every string constant outside env.py that is exactly a variable's name."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "env.py" and path.parent == ROOT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.value!r}")
    return out


def test_no_module_but_env_names_a_pdserve_variable():
    assert names_outside_env() == []


def test_the_scan_sees_a_name_and_the_knobs_are_named_once():
    tree = ast.parse('import os\nx = os.environ.get("PDSERVE_SOMETHING")\n"see $PDSERVE_X in the help"')
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and NAME.fullmatch(str(n.value))]
    assert found == ["PDSERVE_SOMETHING"]
    assert all(name.startswith("PDSERVE_") and knob.help for name, knob in env.KNOBS.items())


def test_values_are_read_one_way_and_bad_ones_are_errors(monkeypatch):
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    assert not env.NATIVE.on()
    monkeypatch.delenv("PDSERVE_NATIVE")
    assert env.NATIVE.on()  # its default
    monkeypatch.setenv("PDSERVE_NATIVE", "yes")
    with pytest.raises(ValueError, match="PDSERVE_NATIVE must be 0 or 1"):
        env.NATIVE.on()
    monkeypatch.setenv("PDSERVE_TEST_STEP_DELAY_S", "soon")
    with pytest.raises(ValueError, match="PDSERVE_TEST_STEP_DELAY_S must be a number"):
        env.TEST_STEP_DELAY_S.number()
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "")
    assert env.ADMIN_TOKEN.text() is None  # empty is unset
