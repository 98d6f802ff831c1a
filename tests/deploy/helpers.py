"""What tests/deploy reads from deploy/: the kustomize output and the compose files' commands."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = ("k8s/base", "k8s/overlays/gpu", "k8s/overlays/multinode")
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
COMPOSE_GPU = DEPLOY / "compose" / "docker-compose.gpu.yml"
COMPOSE_MULTINODE = DEPLOY / "compose" / "docker-compose.multinode.yml"
MODEL_IN_IMAGE = "/models/small-glm_moe_dsa-seed0"


def kustomize(path: str) -> list[dict]:
    """`kubectl kustomize deploy/PATH` as a list of resources (fails the test if it does not build)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to build the kustomize output"
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def as_deployments(resources: list[dict]) -> list[dict]:
    """The resources with each LeaderWorkerSet's pod templates as Deployments (its leader under its
    own name, its workers under NAME-worker), so the checks of Deployments (schemas, hardening,
    checkov) reach them; the LeaderWorkerSet's own fields are checked by test_deploy_manifests."""
    out = []
    for r in resources:
        if r["kind"] != "LeaderWorkerSet":
            out.append(r)
            continue
        group = r["spec"]["leaderWorkerTemplate"]
        for suffix, key in (("", "leaderTemplate"), ("-worker", "workerTemplate")):
            tpl = copy.deepcopy(group[key])
            meta = {**copy.deepcopy(r["metadata"]), "name": r["metadata"]["name"] + suffix}
            spec = {
                "replicas": 1,
                "selector": {"matchLabels": dict(tpl["metadata"]["labels"])},
                "template": tpl,
            }
            out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec})
    return out


def lws_env(where: str) -> dict[str, str]:
    """What the LeaderWorkerSet controller sets in a pod of a group of 2 (none outside one)."""
    if "multinode" not in where:
        return {}
    worker = "-worker/" in where
    return {
        "LWS_GROUP_SIZE": "2",
        "LWS_WORKER_INDEX": "1" if worker else "0",
        "LWS_LEADER_ADDRESS": "127.0.0.1",
    }


def k8s_commands(resources: list[dict], model: str) -> list[tuple[str, list[str]]]:
    """(where, args) of every container and init container, $(VAR) references resolved from the
    container's env (ConfigMap keys from the rendered ConfigMap, the pod IP as 127.0.0.1)."""
    maps = {r["metadata"]["name"]: r.get("data", {}) for r in resources if r["kind"] == "ConfigMap"}
    out = []
    for r in as_deployments(resources):
        if r["kind"] != "Deployment":
            continue
        spec = r["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            env = {}
            for ref in c.get("envFrom", []):
                env.update(maps[ref["configMapRef"]["name"]])
            for e in c.get("env", []):
                src = e.get("valueFrom", {})
                if "configMapKeyRef" in src:
                    env[e["name"]] = maps[src["configMapKeyRef"]["name"]][src["configMapKeyRef"]["key"]]
                elif "fieldRef" in src:
                    env[e["name"]] = "127.0.0.1"
                elif "value" in e:
                    env[e["name"]] = e["value"]
            env["MODEL"] = model if "MODEL" in env else None
            args = list(c.get("command", [])) + list(c.get("args", []))
            args = [
                re.sub(r"\$\((\w+)\)", lambda m, env=env, c=c: _lookup(env, m.group(1), c["name"]), a)
                for a in args
            ]
            out.append((f"{r['metadata']['name']}/{c['name']}", args))
    return out


def _lookup(env: dict, name: str, where: str) -> str:
    assert env.get(name) is not None, f"{where}: $({name}) is not defined in the container's env"
    return env[name]


def compose_commands(model: str) -> list[tuple[str, list[str]]]:
    """(where, command) of every pdserve service in the compose file and its GPU and multi-node overrides."""
    out = []
    for path in (COMPOSE, COMPOSE_GPU, COMPOSE_MULTINODE):
        for name, svc in yaml.safe_load(path.read_text())["services"].items():
            if "command" in svc and "prometheus" not in str(svc.get("image", "")):
                out.append(
                    (f"{path.name}:{name}", [model if a == MODEL_IN_IMAGE else a for a in svc["command"]])
                )
    return out


def checkov() -> str:
    """The checkov executable: $PDSERVE_CHECKOV, else the venv `make scan-tools` builds (checkov's pins
    would downgrade packaging and networkx in the project venv, so it gets its own)."""
    env = os.environ.get("PDSERVE_CHECKOV")
    if env:
        return env
    version = re.search(r"^CHECKOV_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    path = Path.home() / ".cache" / "pdserve" / f"checkov-{version}" / "bin" / "checkov"
    assert path.is_file(), (
        f"checkov {version} is not installed: run `make scan-tools` (or set PDSERVE_CHECKOV)"
    )
    return str(path)
