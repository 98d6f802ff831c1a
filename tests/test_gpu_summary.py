"""tests/gpu/summary.py, the device check's JSON (it runs on the GPU machine, but is plain Python):
a check cut short by the time limit is neither passed nor counted, and the run says it was cut."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SUMMARY = Path(__file__).parent / "gpu" / "summary.py"
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.gpu.test_a" name="test_bad" time="0.1"><failure message="boom">x</failure></testcase>
<testcase time="0.21"/>
</testsuite></testsuites>"""


def test_interrupted_check_is_not_passed(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    (tmp_path / "env.json").write_text("{}")
    out = tmp_path / "out.json"
    args = [tmp_path / "j.xml", tmp_path / "env.json", out, "2", "148"]
    subprocess.run([sys.executable, SUMMARY, *map(str, args)], check=True, capture_output=True)
    got = json.loads(out.read_text())
    assert [c["name"] for c in got["checks"]] == ["tests.gpu.test_a::test_ok", "tests.gpu.test_a::test_bad"]
    assert (got["passed"], got["failed"], got["interrupted"], got["all_passed"]) == (1, 1, True, False)
