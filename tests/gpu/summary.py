"""The JSON summary of tests/gpu/device_check.sh: environment, one entry per check, the verdict.

usage: python tests/gpu/summary.py JUNIT_XML ENV_JSON OUT_JSON PYTEST_RC ELAPSED_S
(no pytest import: the summary is written even when pytest itself failed to run)"""

from __future__ import annotations

import datetime
import json
import sys
import xml.etree.ElementTree as ET


def checks(junit: str) -> list[dict]:
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        if case.get("name") is None:  # what pytest writes for the check a SIGINT cut short
            continue
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (node.get("message") or node.text or "")[:2000]
        out.append(
            {
                "name": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "time_s": round(float(case.get("time") or 0), 2),
                "message": message,
            }
        )
    return out


def main(junit: str, env_json: str, out_json: str, rc: str, elapsed: str) -> None:
    results = checks(junit)
    count = {k: sum(r["outcome"] == k for r in results) for k in ("passed", "failed", "error", "skipped")}
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": json.load(open(env_json)),
        "elapsed_s": int(elapsed),
        "pytest_exit_code": int(rc),
        "interrupted": int(rc) in (2, 124, 137),  # pytest stopped by the time limit: checks missing
        **count,
        "all_passed": int(rc) == 0 and count["failed"] == count["error"] == 0 and count["passed"] > 0,
        "checks": results,
    }
    with open(out_json, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"device check: {count} in {elapsed} s -> {out_json}")


if __name__ == "__main__":
    main(*sys.argv[1:6])
