"""Every container command in deploy/ (the kustomize output of the base and the GPU overlay, the
compose file and its GPU override) is accepted by the real `pdserve` CLI: each argument list runs
with --check-config (parse + validate, nothing starts), the image's model path replaced by a tiny
checkpoint. The image's entrypoint is `pdserve`, so the argument list is the whole command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdserve.cli.main import app
from pdserve.serving.auth import new_token
from tests.deploy.helpers import KUSTOMIZATIONS, compose_commands, k8s_commands, kustomize, lws_env


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints[("glm_moe_dsa", "make-model")])


@pytest.fixture(scope="module")
def token(tmp_path_factory) -> Path:
    """The Secret the manifests mount: --check-config reads and checks a given --internal-token-file."""
    path = tmp_path_factory.mktemp("secret") / "internal-token"
    path.write_text(new_token())
    return path


def check(args: list[str], token_file: Path, where: str = ""):
    if "--internal-token-file" in args:
        args = _with(args, "--internal-token-file", str(token_file))
    env = {"PDSERVE_ADMIN_TOKEN": "", "PDSERVE_INTERNAL_TOKEN": "", **lws_env(where)}
    return CliRunner().invoke(app, [*args, "--check-config"], env=env)


def all_commands(model: str) -> list[tuple[str, list[str]]]:
    out = []
    for path in KUSTOMIZATIONS:
        out += [(f"{path}:{where}", args) for where, args in k8s_commands(kustomize(path), model)]
    return out + compose_commands(model)


def test_every_deploy_command_passes_check_config(model, token):
    commands = all_commands(model)
    roles = {args[0] for _, args in commands}
    assert roles == {"make-model", "prefill", "decode", "router"}, roles
    seen = {}
    for where, args in commands:
        key = (tuple(args), tuple(lws_env(where).items()))
        if key not in seen:
            result = check(args, token, where)
            assert result.exit_code == 0, f"{where}: pdserve {' '.join(args)}\n{result.output}"
            seen[key] = json.loads(result.stdout.strip().splitlines()[-1])
    # the topology of `make serve`: C_p = 2, W = C_d = 2 everywhere
    configs = list(seen.values())
    assert all(c["cp_size"] == 2 for c in configs if "cp_size" in c)
    assert all(c["tp_size"] == 2 and c["dcp_size"] == 2 for c in configs if "dcp_size" in c)
    # the GPU variants run the ranks on the GPUs (bf16 by default there), the base ones on the CPU
    servers = [c for c in configs if "cp_size" in c or "dcp_size" in c]
    assert {(c["device"], c["dtype"]) for c in servers} == {("cpu", "float32"), ("cuda", "bfloat16")}
    # one instance over 2 nodes: the LeaderWorkerSets' pods (from the controller's variables) and
    # the multi-node compose file's two prefill containers
    groups = [c for c in servers if c["nnodes"] == 2]
    assert {(c.get("cp_size", 0), c["node_rank"]) for c in groups} == {(0, 0), (0, 1), (2, 0), (2, 1)}
    assert {c["dist_addr"] for c in groups} == {"127.0.0.1", "prefill:29500"}
    k8s_router = [c for c in configs if c.get("discovery") == "k8s"]
    assert k8s_router and all(c["selector"] == "app.kubernetes.io/part-of=pdserve" for c in k8s_router)


def _with(args: list[str], flag: str, value: str) -> list[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def test_a_broken_command_is_rejected(model, token):
    """The check can fail: the compose decode command with an unknown flag, or with C_d = 3 on W = 2."""
    decode = next(args for _, args in compose_commands(model) if args[0] == "decode")
    assert check(decode, token).exit_code == 0
    assert check(decode + ["--no-such-flag"], token).exit_code == 2
    assert check(_with(decode, "--dcp-size", "3"), token).exit_code == 2


def test_the_mounted_token_file_is_read(model, token, tmp_path):
    """The manifests' --internal-token-file is read even by --check-config: a weak or missing one fails."""
    prefill = next(
        args
        for where, args in all_commands(model)
        if args[0] == "prefill" and "--internal-token-file" in args
    )
    assert check(prefill, token).exit_code == 0
    (tmp_path / "weak").write_text("change" + "-me")
    assert check(prefill, tmp_path / "weak").exit_code != 0
    assert check(prefill, tmp_path / "missing").exit_code != 0


def test_up_check_config(model, token):
    """`make serve`'s command line, checked the same way (up got --check-config for it)."""
    ok = check(["up", "--model", model, "--prefill-cp", "2", "--decode-tp", "2", "--decode-dcp", "2"], token)
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["decode_dcp"] == 2
    assert check(["up", "--model", model, "--decode-tp", "3", "--decode-dcp", "2"], token).exit_code == 2
