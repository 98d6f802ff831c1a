"""The container image and the compose stack for real, with the dockerd that `.ci/system` starts
in a network namespace with loopback only (DOCKER_HOST, PDSERVE_DOCKER_NETNS): nothing in the
build or the stack can reach a network.

- deploy/wheelhouse.sh downloads the wheels on the host, deploy/docker/debootstrap-base.sh makes the
  base image, and deploy/docker/Dockerfile builds from them offline (pip --no-index); the image runs
  as uid 10001 and `pdserve --help` works. Its size is printed and written to bench/results.
- `docker-compose -f deploy/compose/docker-compose.yml up` with that image: router, prefill
  (C_p = 2), decode (W = C_d = 2) turn healthy; the README quickstart requests (curl, the openai
  client) answer through the published router port, the temperature-0 text equal to the
  single-rank engine's; `docker-compose down` leaves no container, network or volume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams
from tests.system.conftest import missing
from tests.system.netns import in_netns

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
MODEL = "small-glm_moe_dsa-seed0"
NETNS = os.environ.get("PDSERVE_DOCKER_NETNS", "")
DOCKER = os.environ.get("DOCKER", "docker")

reason = missing("docker-compose", "debootstrap", "curl") or (
    None if os.environ.get("DOCKER_HOST") and NETNS else "system test: needs .ci/system's dockerd"
)
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")


def sh(*cmd: str, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Runs cmd, raising with its output when it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, (
        f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    )
    return r


def ns_sh(*cmd: str) -> str:
    """A command inside dockerd's namespace (where the router's port is published)."""
    return sh("ip", "netns", "exec", NETNS, *cmd, timeout=120).stdout


@pytest.fixture(scope="module")
def image():
    tag = f"pdserve:system-{uuid.uuid4().hex[:8]}"
    timings = {}
    t0 = time.monotonic()
    sh(str(ROOT / "deploy" / "wheelhouse.sh"), env={**os.environ, "PYTHON": sys.executable})
    timings["wheelhouse_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    sh(str(ROOT / "deploy" / "docker" / "debootstrap-base.sh"), "pdserve-base:bookworm")
    timings["base_s"] = time.monotonic() - t0
    # no route out of dockerd's namespace: the build is offline or it fails
    assert "default" not in ns_sh("ip", "route")
    t0 = time.monotonic()
    build = sh(
        DOCKER,
        "build",
        "--network",
        "host",
        "-f",
        "deploy/docker/Dockerfile",
        "--build-arg",
        "BASE_IMAGE=pdserve-base:bookworm",
        "-t",
        tag,
        ".",
        cwd=ROOT,
    )
    timings["build_s"] = time.monotonic() - t0
    assert "offline build: wheels from the wheelhouse only" in build.stdout
    try:
        yield tag, timings
    finally:
        subprocess.run([DOCKER, "rmi", "-f", tag, "pdserve-base:bookworm"], capture_output=True)


def test_image_runs_as_non_root_and_has_the_cli(image, tmp_path):
    tag, timings = image
    assert sh(DOCKER, "run", "--rm", "--entrypoint", "id", tag, "-u").stdout.strip() == "10001"
    assert "prefill" in sh(DOCKER, "run", "--rm", tag, "--help").stdout
    torch = sh(
        DOCKER, "run", "--rm", "--entrypoint", "python3", tag, "-c", "import torch; print(torch.__version__)"
    )
    assert torch.stdout.strip() == "2.13.0+cpu"
    size = int(sh(DOCKER, "image", "inspect", "-f", "{{.Size}}", tag).stdout)
    base = int(sh(DOCKER, "image", "inspect", "-f", "{{.Size}}", "pdserve-base:bookworm").stdout)
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "image_bytes": size,
        "base_bytes": base,
        **{k: round(v, 1) for k, v in timings.items()},
    }
    print(f"\nimage {tag}: {size / 1e9:.2f} GB (base {base / 1e6:.0f} MB); {record}")
    # a test writes only temporary files: PDSERVE_IMAGE_RECORD=bench/results/image_cpu.json
    # records a run in the committed results on purpose
    out = Path(os.environ.get("PDSERVE_IMAGE_RECORD") or tmp_path / "image_cpu.json")
    out.write_text(json.dumps(record, indent=1) + "\n")


def compose(project: str, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return sh("docker-compose", "-p", project, "-f", str(COMPOSE), *args, env=env, timeout=timeout)


def health(project: str, service: str) -> str:
    ids = sh(DOCKER, "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
    for cid in ids:
        info = json.loads(sh(DOCKER, "inspect", cid).stdout)[0]
        if info["Config"]["Labels"].get("com.docker.compose.service") == service:
            return (info["State"].get("Health") or {}).get("Status", info["State"]["Status"])
    return "absent"


def quickstart(port: int) -> dict:
    """The README quickstart's openai-client requests (run inside dockerd's namespace)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    text = (
        client.completions.create(model=model, prompt="Hello", max_tokens=16, temperature=0).choices[0].text
    )
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16, stream=True
    )
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    # beyond the quickstart: the token ids of the same temperature-0 completion
    ids = client.completions.create(
        model=model, prompt="Hello", max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    return {"model": model, "text": text, "finish": finish, "ids": ids.choices[0].model_extra["token_ids"]}


def test_compose_stack_answers_the_quickstart_exactly(image, tmp_path):
    tag, _ = image
    project = f"pdsv{os.getpid()}"
    env = {**os.environ, "PDSERVE_IMAGE": tag, "PDSERVE_INTERNAL_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex}
    from pdserve.checkpoints.random_checkpoint import make_model

    model_dir = make_model(tmp_path / MODEL, "glm_moe_dsa", "small", seed=0)
    try:
        t0 = time.monotonic()
        compose(project, env, "up", "-d", "--no-build")
        deadline = time.monotonic() + 600
        while (states := {s: health(project, s) for s in ("router", "prefill", "decode")}) != dict.fromkeys(
            ("router", "prefill", "decode"), "healthy"
        ):
            assert time.monotonic() < deadline, f"not healthy in 600 s: {states}"
            assert "unhealthy" not in states.values() and "exited" not in states.values(), states
            time.sleep(2)
        print(f"\ncompose stack healthy in {time.monotonic() - t0:.0f} s")
        # the README quickstart, word for word but the temperature-0 check
        models = json.loads(ns_sh("curl", "-s", "localhost:8000/v1/models"))
        assert [m["id"] for m in models["data"]] == [MODEL]
        body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 16, "temperature": 0})
        curl = ns_sh(
            "curl", "-s", "localhost:8000/v1/completions", "-H", "Content-Type: application/json", "-d", body
        )
        got = in_netns(NETNS, quickstart, 8000)

        tok = Tokenizer.from_pretrained(model_dir)
        engine = LLMEngine.from_pretrained(model_dir)
        want_ids = engine.generate([tok.encode("Hello")], SamplingParams(max_tokens=16))[0]
        want = tok.decode(want_ids)
        assert json.loads(curl)["choices"][0]["text"] == want
        assert got["model"] == MODEL and got["text"] == want and got["ids"] == want_ids
        assert got["finish"] in (["length"], ["stop"])  # the sampled chat stream (no temperature) ended
    finally:
        logs = subprocess.run(
            ["docker-compose", "-p", project, "-f", str(COMPOSE), "logs", "--tail", "20"],
            env=env,
            capture_output=True,
            text=True,
        )
        print(logs.stdout[-3000:])
        compose(project, env, "down", "-v", "--remove-orphans")
    left = sh(DOCKER, "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
    assert left == [], left
    volumes = sh(DOCKER, "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}")
    assert volumes.stdout.split() == []
