"""`pdserve up`: the whole stack (prefill C_p = 2, decode W = C_d = 2) as one command, with a copied
index over NIXL, a split index over NIXL and a copied index over TCP (test_router_e2e.py runs the
split index over TCP).

It prints the router URL once every process is healthy; a request like the printed example works
with the openai client and greedy ids equal the single-rank engine's; SIGTERM stops the launcher,
every process it started and their ranks. The `make serve` topology (copied index, TCP) also runs
the README's quickstart as written (its curl and openai-client blocks, with this test's port and
model), and its flags are checked against the Makefile's `serve` recipe.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.reference import free_port
from tests.servers import http, pid_alive, wait_until

ROOT = Path(__file__).resolve().parents[2]


def make_serve_args() -> list[str]:
    """The flags `make serve` gives `pdserve up`."""
    recipe = ROOT.joinpath("Makefile").read_text().split("\nserve:")[1].splitlines()[1]
    args = shlex.split(recipe)
    assert args[0].endswith("/bin/pdserve") and args[1] == "up", recipe
    return args[2:]


def run_readme_quickstart(port: int, model: str) -> None:
    """The README's quickstart blocks as a user would paste them, pointed at this test's router."""
    text = ROOT.joinpath("README.md").read_text().split("## Quickstart")[1].split("\n## ")[0]
    bash, python = re.findall(r"```(?:bash|python)\n(.*?)```", text, re.S)
    bash = bash.replace("localhost:8000", f"127.0.0.1:{port}").replace("small-glm_moe_dsa-seed0", model)
    out = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and f'"id":"{model}"' in out.stdout and '"text_completion"' in out.stdout, out
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(python.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), {})
    assert len(out.getvalue().strip()) > 0


def check_openai_api_through_up(client, model: str, engine: LLMEngine) -> None:
    """The OpenAI API beyond plain sampling through `pdserve up` (tests/router/test_openai_api.py has
    the thorough checks): logprobs equal the single-rank engine's, n = 4 seeded choices repeat,
    a JSON-schema answer validates."""
    import jsonschema
    import torch

    kw = dict(
        model=model, prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    r = client.completions.create(**kw, temperature=0, logprobs=3)
    ids = [5, 6, 7] + r.choices[0].model_extra["token_ids"]
    ref = torch.log_softmax(engine.prefill_logits(ids)[2:-1].double(), -1)
    got = r.choices[0].logprobs.token_logprobs
    assert all(abs(g - row[t].item()) < 1e-4 for g, row, t in zip(got, ref, ids[3:], strict=True))
    four = [c.model_extra["token_ids"] for c in client.completions.create(**kw, n=4, seed=3).choices]
    assert four == [c.model_extra["token_ids"] for c in client.completions.create(**kw, n=4, seed=3).choices]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    m = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=32, seed=1, response_format=fmt
    )
    jsonschema.validate(json.loads(m.choices[0].message.content), schema)


@pytest.mark.slow
@pytest.mark.parametrize(
    "index,transfer,stop",
    [("copy", "nixl", "SIGTERM"), ("split", "nixl", "SIGTERM twice"), ("copy", "tcp", "SIGKILL")],
)
def test_up_serves_and_stops_cleanly(model_dir, tmp_path, index, transfer, stop):
    """stop: how the launcher is stopped. A repeated SIGTERM must not cut its cleanup short; a killed
    launcher takes every process it started with it (they get SIGTERM when it dies)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(model_dir),
            "--prefill-cp",
            "2",
            "--decode-tp",
            "2",
            "--decode-dcp",
            "2",
            "--dcp-index",
            index,
            "--transfer",
            transfer,
            "--max-kv-tokens",
            "1024",
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path),
            "--ready-timeout",
            "120",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any(line.startswith("ready: ") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        out = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in out and "curl " in out, out
        pids = [int(p) for p in re.findall(r"\(pid (\d+),", out)]
        assert len(pids) == 3  # prefill, decode, router
        # each child leads a process group of its own (Ctrl-C reaches the launcher only) inside the
        # launcher's session: a session of its own would be a scheduler autogroup of its own, and
        # the kernel would share the cores per instance instead of per rank
        assert all(os.getpgid(p) == p and os.getsid(p) == os.getsid(proc.pid) for p in pids)
        p_url = re.search(r"prefill-0: (\S+)", out).group(1)
        d_url = re.search(r"decode-0: (\S+)", out).group(1)
        ranks = http.get(f"{p_url}/info").json()["ranks"] + http.get(f"{d_url}/capacity").json()["ranks"]
        pids += [r["pid"] for r in ranks]
        assert len(pids) == 7
        model = re.search(r"\"model\": \"([^\"]+)\"", out).group(1)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        r = client.completions.create(
            model=model, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        engine = LLMEngine.from_pretrained(model_dir)
        for n in (
            1,
            5,
            64,
            300,
        ):  # greedy through the hand-off into the DCP ranks equals the single-rank engine
            ids = [(13 * i + n) % 500 + 4 for i in range(n)]
            want = engine.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0]
            r = client.completions.create(
                model=model,
                prompt=ids,
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert r.choices[0].model_extra["token_ids"] == want, n
        if transfer == "nixl" and index == "copy":
            check_openai_api_through_up(client, model, engine)
        chat = dict(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        whole = client.chat.completions.create(**chat).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**chat, stream=True)
            if c.choices
        )
        assert whole and streamed == whole
        if (index, transfer) == ("copy", "tcp"):  # `make serve`: pdserve up's defaults for these two
            flags = make_serve_args()
            pairs = set(zip(proc.args, proc.args[1:]))
            assert all((f, v) in pairs for f, v in zip(flags[::2], flags[1::2])), (flags, proc.args)
            run_readme_quickstart(port, model)
    finally:
        if stop == "SIGKILL":
            proc.kill()
        else:
            proc.send_signal(signal.SIGTERM)
            if stop == "SIGTERM twice":
                wait_until(lambda: "stopping" in "".join(lines), "up to say it is stopping", 10)
                proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    if stop == "SIGKILL":
        assert code == -signal.SIGKILL
    else:
        assert code == 0 and "stopping" in "".join(lines), "".join(lines)
    deadline = time.monotonic() + 30  # after SIGKILL the children stop on their own
    while [p for p in pids if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)]
