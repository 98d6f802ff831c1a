"""Issue 13 item 5, deployment part: hardened pods (securityContext, writable mounts, memory limits,
no service-account token on instances), the internal token from the operator's Secret, the
NetworkPolicies' reach (evaluated, not just present), no default token anywhere, and a compose file
that publishes only the router, on 127.0.0.1 by default, with its services hardened."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.helpers import (
    COMPOSE,
    COMPOSE_GPU,
    COMPOSE_MULTINODE,
    DEPLOY,
    KUSTOMIZATIONS,
    as_deployments,
    kustomize,
)

TOKEN_FILE = "/var/run/secrets/pdserve/internal-token"
HARDENED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
WRITABLE = {
    "router": {"/models", "/tmp", "/home/pdserve"},
    "prefill": {"/models", "/tmp", "/home/pdserve", "/dev/shm"},
}
WRITABLE["decode"] = WRITABLE["prefill"]
WRITABLE |= {f"{role}-worker": WRITABLE[role] for role in ("prefill", "decode")}  # LeaderWorkerSets'


def _pods(path: str) -> dict[str, dict]:
    return {
        r["metadata"]["name"].removeprefix("pdserve-"): r["spec"]["template"]
        for r in as_deployments(kustomize(path))
        if r["kind"] == "Deployment"
    }


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_pods_are_hardened(path):
    for role, tpl in _pods(path).items():
        spec = tpl["spec"]
        assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["seccompProfile"], role
        # discovery needs the router's token; an instance never talks to the API
        assert spec.get("automountServiceAccountToken", True) is (role == "router"), role
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["initContainers"] + spec["containers"]:
            assert c["securityContext"] == HARDENED, (role, c["name"])
            res = c["resources"]
            assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"], (
                role,
                c["name"],
            )
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
            assert {p for p, v in mounts.items() if "emptyDir" in v} >= (
                WRITABLE[role] if c in spec["containers"] else {"/models", "/tmp", "/home/pdserve"}
            )
        main = spec["containers"][0]
        args = main["args"]
        assert args[args.index("--internal-token-file") + 1] == TOKEN_FILE, role
        mount = next(m for m in main["volumeMounts"] if TOKEN_FILE.startswith(m["mountPath"] + "/"))
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "pdserve-internal" and mount["readOnly"], role
        assert secret["items"] == [{"key": "token", "path": TOKEN_FILE.rsplit("/", 1)[1]}], role
        shm = volumes.get("dshm", {}).get("emptyDir", {}).get("sizeLimit")  # memory-backed: under the limit
        if shm:
            assert _gi(shm) < _gi(main["resources"]["limits"]["memory"]), role


def _gi(q: str) -> float:
    return float(q.removesuffix("Gi"))


def test_no_default_token():
    """No Secret is rendered (the operator creates them), every token reaches a container from a
    Secret, the admin token and API key optionally; compose takes them from the host unset-by-default."""
    for path in KUSTOMIZATIONS:
        resources = kustomize(path)
        assert not [r for r in resources if r["kind"] == "Secret"], path
        for role, tpl in _pods(path).items():
            for c in tpl["spec"]["containers"] + tpl["spec"]["initContainers"]:
                for e in c.get("env", []):
                    if re.search("TOKEN|KEY$", e["name"]):
                        ref = e["valueFrom"]["secretKeyRef"]
                        assert ref.get("optional") is True and ref["name"].startswith("pdserve-"), (role, e)
    for f in list(DEPLOY.rglob("*.y*ml")) + [DEPLOY / "README.md"]:
        assert "change-me" not in f.read_text(), f
    for f in (COMPOSE, COMPOSE_GPU, COMPOSE_MULTINODE):
        for name, svc in yaml.safe_load(f.read_text())["services"].items():
            for var, value in (svc.get("environment") or {}).items():
                if re.search("TOKEN|KEY$", var):
                    assert re.fullmatch(rf"\$\{{{var}:(-|\?[^}}]+)\}}", value), (f.name, name, var, value)


def _selects(selector: dict, labels: dict) -> bool:
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    return ok and all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def reaches(policies: list[dict], src: dict | None, dst: dict, port: int) -> bool:
    """Kubernetes' ingress semantics for TCP: src labels (None: outside the namespace's pods)."""
    selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for spec in selecting:
        for rule in spec.get("ingress", []):
            peer = "from" not in rule or any(
                src is not None and "podSelector" in f and _selects(f["podSelector"], src)
                for f in rule["from"]
            )
            ports = "ports" not in rule or any(
                p["port"] <= port <= p.get("endPort", p["port"]) for p in rule["ports"]
            )
            if peer and ports:
                return True
    return False


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_network_policies(path):
    resources = kustomize(path)
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    pods = {role: tpl["metadata"]["labels"] for role, tpl in _pods(path).items()}
    router, prefill, decode, stranger = pods["router"], pods["prefill"], pods["decode"], {"app": "other"}
    for src in (None, stranger, prefill, decode):
        assert reaches(policies, src, router, 8000)
    assert not reaches(policies, decode, router, 8100)
    for dst, http, peer in ((prefill, 8100, decode), (decode, 8200, prefill)):
        assert reaches(policies, router, dst, http)
        for src in (None, stranger, peer, dst):  # instance HTTP: the router only
            assert not reaches(policies, src, dst, http), (src, dst)
        for port in (1024, 29500, 49152, 65535):  # side channel, data receivers: the other role only
            assert reaches(policies, peer, dst, port) and not reaches(policies, router, dst, port)
            assert not reaches(policies, stranger, dst, port) and not reaches(policies, None, dst, port)
    assert reaches(policies, None, {"app": "unrelated"}, 1)  # the default deny is pdserve's pods only
    for role, http in (("prefill", 8100), ("decode", 8200)):  # a group's pods reach each other
        worker = pods.get(f"{role}-worker")
        if worker is None:
            continue
        leader, other = pods[role], pods["decode" if role == "prefill" else "prefill"]
        for port in (29500, 29501, 29600, 29601, 40000):  # rendezvous, node link, gloo
            assert reaches(policies, worker, leader, port) and reaches(policies, leader, worker, port)
            assert not reaches(policies, router, worker, port) and not reaches(policies, None, worker, port)
        assert not reaches(policies, worker, leader, http) and not reaches(policies, other, worker, http)


def test_compose_publishes_only_the_router():
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]
    published = {n for s in (base, gpu) for n, svc in s.items() if svc.get("ports")}
    assert published == {"router", "prometheus"} and base["prometheus"]["profiles"] == ["monitoring"]
    for name in published:
        for spec in base[name]["ports"]:
            host, _, _ = (
                re.sub(r"\$\{PDSERVE_BIND:-([^}]+)\}", r"\1", spec).rpartition(":")[0].rpartition(":")
            )
            assert host == "127.0.0.1" and spec.startswith("${PDSERVE_BIND:-"), spec
    for name in ("model", "router", "prefill", "decode"):
        svc = base[name]
        assert (
            svc["read_only"]
            and svc["cap_drop"] == ["ALL"]
            and "no-new-privileges:true" in svc["security_opt"]
        )
        assert svc["mem_limit"] and {t.split(":")[0] for t in svc["tmpfs"]} == {"/tmp", "/home/pdserve"}, name
    for name in ("router", "prefill", "decode"):
        assert base[name]["environment"]["PDSERVE_INTERNAL_TOKEN"].startswith("${PDSERVE_INTERNAL_TOKEN:?"), (
            name
        )
    assert "PDSERVE_ADMIN_TOKEN" not in base["prefill"]["environment"]
    assert gpu["prefill"]["mem_limit"] and gpu["decode"]["mem_limit"]
    node1 = yaml.safe_load(COMPOSE_MULTINODE.read_text())["services"]["prefill-node1"]
    assert (
        node1["read_only"]
        and node1["cap_drop"] == ["ALL"]
        and "no-new-privileges:true" in node1["security_opt"]
    )
    assert node1["mem_limit"] and not node1.get("ports")
