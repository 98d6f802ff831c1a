"""deploy/: the kustomize output builds and validates offline against the Kubernetes schemas; the
compose files have the services, health checks, shared memory and GPU reservations issue 7 asks."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
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

K8S_VERSION = "1.32"  # the version kubectl here speaks; the schemas come with kubernetes-validate
# A LeaderWorkerSet's own fields (leaderworkerset.x-k8s.io/v1, sigs.k8s.io/lws's CRD): its pod
# templates are validated by kubernetes-validate as Deployments (helpers.as_deployments)
_TEMPLATE = {"type": "object", "required": ["metadata", "spec"]}
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {"type": "object"},
                "networkConfig": {"type": "object"},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate", "size"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                        "leaderTemplate": _TEMPLATE,
                        "workerTemplate": _TEMPLATE,
                        "subGroupPolicy": {"type": "object"},
                    },
                },
            },
        },
    },
}
KINDS = [
    "ConfigMap/pdserve-config",
    "Deployment/pdserve-decode",
    "Deployment/pdserve-prefill",
    "Deployment/pdserve-router",
    "NetworkPolicy/pdserve-decode",
    "NetworkPolicy/pdserve-default-deny",
    "NetworkPolicy/pdserve-prefill",
    "NetworkPolicy/pdserve-router",
    "Role/pdserve-pod-reader",
    "RoleBinding/pdserve-router-pod-reader",
    "Service/pdserve-router",
    "ServiceAccount/pdserve-router",
]
GROUP_KINDS = [  # the multinode overlay: the instances as LeaderWorkerSets, and their pods' policies
    k.replace("Deployment/pdserve-decode", "LeaderWorkerSet/pdserve-decode").replace(
        "Deployment/pdserve-prefill", "LeaderWorkerSet/pdserve-prefill"
    )
    for k in KINDS
] + ["NetworkPolicy/pdserve-decode-group", "NetworkPolicy/pdserve-prefill-group"]


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomize_output_is_valid_kubernetes(path):
    resources = kustomize(path)
    for r in as_deployments(resources):
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)  # raises ValidationError naming the field
    for r in resources:
        if r["kind"] == "LeaderWorkerSet":
            jsonschema.validate(r, LWS_SCHEMA)
    kinds = sorted(
        f"{r['kind']}/{r['metadata']['name'].rsplit('-', 1)[0] if r['kind'] in ('ConfigMap', 'Secret') else r['metadata']['name']}"
        for r in resources
    )
    assert kinds == sorted(GROUP_KINDS if "multinode" in path else KINDS)
    deployments = {
        r["metadata"]["name"]: r["spec"]["template"]
        for r in as_deployments(resources)
        if r["kind"] == "Deployment"
    }
    for name, tpl in deployments.items():
        c = tpl["spec"]["containers"][0]
        if name.endswith("-worker"):  # a worker pod serves no HTTP: its leader's link watches it
            assert not {"readinessProbe", "livenessProbe", "ports"} & set(c), name
            assert "pdserve.io/role" not in tpl["metadata"]["labels"], name  # never discovered
        else:
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
            assert c["livenessProbe"]["httpGet"]["path"] == "/live", name
        assert tpl["spec"]["securityContext"]["runAsNonRoot"] is True
    for role in ("prefill", "decode"):  # what the router's discovery needs (pdserve/router/discovery.py)
        tpl = deployments[f"pdserve-{role}"]
        assert tpl["metadata"]["labels"]["pdserve.io/role"] == role
        assert tpl["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve"
        shm = [v for v in tpl["spec"]["volumes"] if v["name"] == "dshm"][0]
        assert shm["emptyDir"]["medium"] == "Memory"
        gpus = tpl["spec"]["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (2 if "gpu" in path else None)
        args = tpl["spec"]["containers"][0]["args"]  # the kubelet's SIGKILL must come after the drain
        grace = float(args[args.index("--shutdown-grace") + 1])
        assert grace + 5 <= tpl["spec"]["terminationGracePeriodSeconds"] <= grace + 60, role
    for r in resources:  # a group: one instance, restarted together when a pod fails
        if r["kind"] == "LeaderWorkerSet":
            group = r["spec"]["leaderWorkerTemplate"]
            assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
            assert (
                group["leaderTemplate"]["spec"]["containers"][0]["args"]
                == (group["workerTemplate"]["spec"]["containers"][0]["args"])
            )  # the same flags on every node; the node settings come from the controller
    router = deployments["pdserve-router"]["spec"]["containers"][0]
    token = [e for e in router["env"] if e["name"] == "PDSERVE_ADMIN_TOKEN"][0]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "pdserve-admin", "key": "token", "optional": True}


def test_a_broken_manifest_is_rejected():
    """The validation can fail: a Deployment with a misspelled field does not pass, nor does a
    LeaderWorkerSet with one (in its own fields, or in a pod template)."""
    bad = [r for r in kustomize("k8s/base") if r["kind"] == "Deployment"][0]
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    group = [r for r in kustomize("k8s/overlays/multinode") if r["kind"] == "LeaderWorkerSet"][0]
    jsonschema.validate(group, LWS_SCHEMA)
    group["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnRestart"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(group, LWS_SCHEMA)
    group["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnPodRestart"
    group["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinesProbe"] = {}
    worker = [d for d in as_deployments([group]) if d["metadata"]["name"].endswith("-worker")][0]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


def test_compose_files():
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]
    assert {"router", "prefill", "decode", "prometheus"} <= set(base)
    for name in ("router", "prefill", "decode"):
        test = base[name]["healthcheck"]["test"]
        assert any("/health" in part for part in test), name
    assert base["prefill"]["shm_size"] and base["decode"]["ipc"] == "service:prefill"
    for name in ("prefill", "decode"):  # docker's SIGKILL must come after the drain
        cmd = base[name]["command"]
        grace = float(cmd[cmd.index("--shutdown-grace") + 1])
        assert int(base[name]["stop_grace_period"].rstrip("s")) >= grace + 5, name
    assert base["prometheus"]["profiles"] == ["monitoring"]
    prom = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["router:8000"]
    for name in ("prefill", "decode"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and len(devices[0]["device_ids"]) == 2
    assert (DEPLOY / "docker" / "Dockerfile").read_text().count('ENTRYPOINT ["pdserve"]') == 1
    # one prefill instance over two containers: the same flags but --node-rank, no IPC shared
    multi = yaml.safe_load(COMPOSE_MULTINODE.read_text())["services"]
    node0, node1 = multi["prefill"]["command"], multi["prefill-node1"]["command"]
    assert [a for a in node0 if a != "0"] == [a for a in node1 if a != "1"]
    assert node0[node0.index("--node-rank") + 1] == "0" and node1[node1.index("--node-rank") + 1] == "1"
    assert node0[node0.index("--nnodes") + 1] == "2" and "prefill:29500" in node0
    assert not {"ipc", "network_mode", "ports"} & set(multi["prefill-node1"])


def test_dockerfile_copies_only_what_dockerignore_keeps():
    """Every COPY source exists and is not excluded by .dockerignore; the image runs as non-root."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    patterns = [
        line.strip().rstrip("/")
        for line in (DEPLOY.parent / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(src: str) -> bool:  # the last matching pattern decides; "!" re-includes
        out = False
        for pat in patterns:
            bare = pat.removeprefix("!")
            if src == bare or src.startswith(bare + "/"):
                out = not pat.startswith("!")
        return out

    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for src in line.split()[1:-1]
    ]
    assert sources and "pdserve" in sources and "deploy/wheelhouse" in sources
    for src in sources:
        assert (DEPLOY.parent / src).exists(), src
        assert not ignored(src), f"{src} is in .dockerignore"
    assert ignored("deploy/compose") and ignored("tests")
    user = [line for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1].split()[1] not in ("root", "0")
    assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
