"""The probe paths the manifests use answer on the real servers: /live (liveness) and /health
(readiness) of a prefill and a decode instance."""

from __future__ import annotations

from tests.deploy.helpers import kustomize
from tests.router.helpers import start_servers, stop_all
from tests.servers import http


def test_probe_paths_answer_on_real_servers(tiny_checkpoints):
    model = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    probes = {}
    for r in kustomize("k8s/base"):
        if r["kind"] == "Deployment":
            c = r["spec"]["template"]["spec"]["containers"][0]
            probes[c["name"]] = {c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")}
    assert probes["prefill"] == probes["decode"] == {"/health", "/live"}
    servers = start_servers(model, [("prefill",), ("decode",)])
    try:
        for (_, url), role in zip(servers, ("prefill", "decode")):
            for path in sorted(probes[role]):
                resp = http.get(f"{url}{path}", timeout=10)
                assert resp.status_code == 200 and resp.json()["status"] == "ok", (role, path, resp.text)
    finally:
        stop_all([proc for proc, _ in servers])
