"""The outside load client of bench/serve.py: SGLang's `sglang.bench_serving`, in a virtualenv of its own.

Nobody on this project wrote it, which is the point: its request loop, its TTFT / ITL / TPOT
definitions and its goodput are SGLang's, run against our OpenAI-compatible `/v1/completions`
(`--backend vllm`, which speaks plain OpenAI completions with `ignore_eos`, streaming).

`import sglang` pulls in a large set (a CUDA torch build, torchvision, triton, ...; about 6 GB), so
it never goes into the project's virtualenv: `ensure()` builds `~/.cache/pdserve/loadclient-sglang-
<version>` once (sglang without its dependencies, then the modules `sglang.bench_serving` imports,
pinned below) and later runs reuse it. Its `random` dataset downloads ShareGPT, which the bench must
not do, so prompts are `random-ids` (random token ids decoded to text: `--tokenize-prompt`, which
would send the ids, works only with SGLang's own backend; the router tokenizes the text, and the
baseline runs the ids our tokenizer gives for the same text) or the local `generated-shared-prefix`
set.

`dataset()` asks the same code for the prompts it will send (same arguments, same seed) so that the
transformers baseline runs exactly those token ids; `run()` runs one load level and returns its
result dict (SGLang's field names)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

SGLANG = "0.5.23"
VENV = Path.home() / ".cache" / "pdserve" / f"loadclient-sglang-{SGLANG}"
# what `import sglang.bench_serving` needs, found by importing it until nothing was missing
# (2026-11-30), at the versions that worked
DEPS = (
    "aiohttp==3.14.5 apache-tvm-ffi==0.1.15.post2 compressed-tensors==0.20.1 datasets==5.2.0 gguf==0.19.0 "
    "ipython==9.18.1 msgspec==0.23.0 numpy==2.4.6 orjson==3.13.0 pillow==13.0.0 psutil==7.2.2 "
    "pybase64==1.5.1 pyzmq==27.3.0 requests==2.34.2 sentencepiece==0.2.3 starlette==1.10.0 "
    "torch==2.14.1 torchvision==0.29.1 tqdm==4.70.1 transformers==5.24.0 triton==3.8.0"
).split()

# Run inside the load client's venv: SGLang's own argument parser and dataset code, with its
# benchmark replaced by "write the prompts it would send" (it seeds random and numpy the same way).
_DUMP = """
import json, random, sys
import numpy as np
import sglang.benchmark.serving as s
from sglang.benchmark.datasets import get_dataset
from sglang.benchmark.utils import get_tokenizer

def dump(args):
    random.seed(args.seed)
    np.random.seed(args.seed)
    rows = get_dataset(args, get_tokenizer(args.tokenizer), args.model)
    json.dump([{"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.output_len}
               for r in rows], open(OUT, "w"))

s.run_benchmark = dump
s.cli_main()
"""


def python() -> Path:
    return VENV / "bin" / "python"


def ensure(log=print) -> Path:
    """The load client's python, building its venv first when it is missing (minutes, once)."""
    stamp = VENV / ".installed"
    if stamp.exists():
        return python()
    log(f"  building the load client venv {VENV} (sglang {SGLANG} and its imports, ~6 GB, once) ...")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python()), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "--no-deps", f"sglang=={SGLANG}"], check=True)
    subprocess.run([*pip, *DEPS], check=True)
    subprocess.run([str(python()), "-c", "import sglang.bench_serving"], check=True)
    stamp.write_text(SGLANG + "\n")
    return python()


def args_for(
    url: str, model: str, tokenizer: str, dataset: dict, num_prompts: int, seed: int, concurrency: int | None
) -> list[str]:
    """bench_serving's command line for one level: dataset = {"name": ..., plus its options}."""
    ds = dict(dataset)
    name = ds.pop("name")
    argv = [
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        name,
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--disable-tqdm",
    ]
    for k, v in ds.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    if concurrency:
        argv += ["--max-concurrency", str(concurrency)]
    return argv


def dataset(url: str, model: str, tokenizer: str, spec: dict, num_prompts: int, seed: int) -> list[dict]:
    """The prompts bench_serving will send for these arguments: [{prompt, prompt_len, output_len}]."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.json"
        code = f"OUT = {str(out)!r}\n" + _DUMP
        argv = args_for(url, model, tokenizer, spec, num_prompts, seed, None)
        p = subprocess.run(
            [str(python()), "-c", code, *argv], capture_output=True, text=True, timeout=600, cwd=d
        )
        if p.returncode or not out.exists():
            raise RuntimeError(f"load client dataset failed: {p.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())


def run(
    url: str,
    model: str,
    tokenizer: str,
    spec: dict,
    num_prompts: int,
    seed: int,
    concurrency: int | None,
    request_rate: float | None = None,
    extra: list[str] = (),
    timeout: float = 3600,
) -> dict:
    """One bench_serving run; its result line (SGLang's names) plus per-request details and its log."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "result.jsonl"
        argv = [
            str(python()),
            "-m",
            "sglang.bench_serving",
            *args_for(url, model, tokenizer, spec, num_prompts, seed, concurrency),
            "--output-file",
            str(out),
            "--output-details",
            *extra,
        ]
        if request_rate is not None:
            argv += ["--request-rate", str(request_rate)]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=d)
        if p.returncode or not out.exists():
            raise RuntimeError(
                f"bench_serving failed (rc {p.returncode}): {p.stdout[-1500:]}{p.stderr[-1500:]}"
            )
        res = json.loads(out.read_text().splitlines()[-1])
        res["command"] = "python -m sglang.bench_serving " + " ".join(argv[3:])
        res["stdout_tail"] = p.stdout.splitlines()[-40:]
        return res
