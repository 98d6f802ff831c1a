"""The README's GPU table, generated from bench/results/gpu_layer.json (stdlib only, no torch).

    python bench/gpu_layer_report.py          rewrite the table between the README's GPU markers
    python bench/gpu_layer_report.py --check  exit 1 if README.md's table differs from the JSON

tests/test_bench_gpu_layer.py runs the check, so the table and the JSON cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu_layer.json"
README = ROOT / "README.md"
START, END = "<!-- gpu-table:start -->", "<!-- gpu-table:end -->"


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def table(doc: dict | None) -> str:
    if doc is None:
        return "No `bench/results/gpu_layer.json` yet: `bench/gpu_layer.py` has not run on a GPU."
    pk = doc.get("peak", {})
    lines = [
        f"`bench/gpu_layer.py` on {doc['device']} ({doc['date']}, torch {doc['torch']}, {doc.get('elapsed_s')} s):"
        f" measured read {_f(pk.get('read_gbps'), 4)} GB/s, bf16 {_f(pk.get('bf16_tflops'), 4)} TFLOP/s,"
        f" fp8 {_f(pk.get('fp8_tflops'), 4)} TFLOP/s. Targets (issue 39):",
        "",
        "| measure | ms | bound ms | of bound | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for s in doc.get("summary", []):
        lines.append(
            f"| {s['measure']} | {_f(s['ms'])} | {_f(s['bound_ms'])} | {_f(s['of_bound'])} | "
            f">= {s['target']} | {'yes' if s['met'] else 'no'} |"
        )
    lines += [
        "",
        "Every row (graphs: one CUDA-graph replay per call; moe/linear: the ops that ran):",
        "",
        "| phase | shape | batch | context | weights | moe | linear | graphs | ms | bound ms | of bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc.get("rows", []):
        lines.append(
            f"| {r['phase']} | {r['shape']} | {r['batch']} | {_f(r['context'])} | {r['weight_dtype']} | "
            f"{r.get('moe_ops', '-')} | {r.get('linear_ops', '-')} | {'yes' if r['graphs'] else 'no'} | "
            f"{_f(r['ms'])} | {_f(r['bound_ms'])} | {_f(r['of_bound'])} |"
        )
    for e in doc.get("errors", []):
        lines.append(f"\nError: {json.dumps(e)}")
    if doc.get("skipped"):
        lines.append(f"\n{len(doc['skipped'])} rows skipped at the run's time cap.")
    return "\n".join(lines)


def render(readme: str, doc: dict | None) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table(doc)}\n{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    doc = json.loads(a.results.read_text()) if a.results.exists() else None
    readme = README.read_text()
    new = render(readme, doc)
    if a.check:
        if new != readme:
            print(
                "README.md's GPU table differs from bench/results/gpu_layer.json: run bench/gpu_layer_report.py"
            )
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
