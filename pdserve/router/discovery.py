"""Kubernetes discovery: the router's instances are the Ready pods that match a label selector.

`pdserve router --discovery k8s --selector KEY=VALUE[,KEY2=VALUE2] [--namespace NS] [--k8s-api URL]`

A discovered pod must carry
- the label `pdserve.io/role`: `prefill` or `decode` (pods without it, like the router's own, are
  skipped),
- optionally the annotation `pdserve.io/port`: its HTTP port (default 8100 for prefill, 8200 for
  decode),
and is registered as `http://<status.podIP>:<port>` while its Ready condition is True and it is
not being deleted. It is removed from the pool when it is deleted, turns unready or loses its IP;
requests already running on it finish (Pool.remove only forgets the instance).

The loop: list the pods (GET /api/v1/namespaces/NS/pods?labelSelector=...), make the pool's
discovered instances equal that list, then watch from the list's resourceVersion (`watch=true`,
one JSON event per line: ADDED / MODIFIED / DELETED / BOOKMARK / ERROR). A watch that ends is
resumed from the last resourceVersion; an ERROR event (410 Gone: too old) or a failed request
starts over with a fresh list after a short back-off. Instances listed with --prefill / --decode
are never touched.

In a pod the API server is https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT with the
service account's token and CA (read again at every connect: bound tokens rotate); --k8s-api
gives another base URL (kubectl proxy, tests). The service account needs get, list and watch on
pods (deploy/k8s/base/rbac.yaml). Torch-free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from .pool import ROLES, Pool

log = logging.getLogger("pdserve.router.discovery")

ROLE_LABEL = "pdserve.io/role"
PORT_ANNOTATION = "pdserve.io/port"
DEFAULT_PORTS = {"prefill": 8100, "decode": 8200}
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_TIMEOUT_S = 300  # the API server closes a watch after this; we resume from the last version
RETRY_S = 1.0


def parse_selector(text: str) -> str:
    """'a=b,c=d' -> the same, checked: equality terms only (what --selector documents)."""
    terms = [t.strip() for t in text.split(",")]
    for t in terms:
        key, eq, value = t.partition("=")
        if not eq or not key.strip() or "=" in value.lstrip("="):
            raise ValueError(f"--selector must be KEY=VALUE[,KEY=VALUE...], got {text!r}")
    return ",".join(terms)


def default_namespace() -> str:
    try:
        return (SA_DIR / "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


def in_cluster_api() -> str:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError("--discovery k8s outside a pod needs --k8s-api URL (no KUBERNETES_SERVICE_HOST)")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


@dataclass(frozen=True)
class PodTarget:
    """What one pod contributes to the pool: None from `target` when it must not be in it."""

    role: str
    url: str


def target(pod: dict) -> PodTarget | None:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    role = (meta.get("labels") or {}).get(ROLE_LABEL)
    ip = status.get("podIP")
    if role not in ROLES or not ip or meta.get("deletionTimestamp"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if not ready:
        return None
    try:
        port = int((meta.get("annotations") or {}).get(PORT_ANNOTATION, DEFAULT_PORTS[role]))
    except ValueError:
        log.warning("pod %s: annotation %s is not a port; skipped", meta.get("name"), PORT_ANNOTATION)
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return PodTarget(role, f"http://{host}:{port}")


class K8sDiscovery:
    """Keeps the pool's discovered instances equal to the selector's Ready pods."""

    def __init__(
        self,
        pool: Pool,
        selector: str,
        namespace: str | None = None,
        api_url: str | None = None,
        on_added=None,
    ):
        self.pool, self.selector = pool, parse_selector(selector)
        self.namespace = namespace or default_namespace()
        self.api_url = (api_url or in_cluster_api()).rstrip("/")
        self.on_added = on_added  # callback(instance): the app starts a poll of a new instance at once
        self.owned: dict[str, PodTarget] = {}  # pod uid (or namespace/name) -> what it registered

    # the pool side ------------------------------------------------------------------------
    def apply(self, pod: dict, deleted: bool = False) -> None:
        meta = pod.get("metadata") or {}
        key = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
        want = None if deleted else target(pod)
        have = self.owned.get(key)
        if have == want:
            return
        if have is not None:
            self._forget(key)
        if want is not None:
            self._register(key, want, meta.get("name"))

    def _register(self, key: str, t: PodTarget, name) -> None:
        try:
            inst = self.pool.add(t.role, t.url)
        except ValueError as e:  # listed statically, or another pod's stale address
            log.warning("pod %s: not registered: %s", name, e)
            return
        self.owned[key] = t
        log.info("discovered %s instance %s (pod %s)", t.role, t.url, name)
        if self.on_added is not None:
            self.on_added(inst)

    def _forget(self, key: str) -> None:
        t = self.owned.pop(key)
        try:
            self.pool.remove(t.url)
            log.info("removed %s instance %s", t.role, t.url)
        except KeyError:  # an operator removed it through /admin already
            pass

    def sync(self, pods: list[dict]) -> None:
        """After a (re)list: drop what is gone, then apply every listed pod."""
        listed = {
            (p.get("metadata") or {}).get("uid")
            or f"{p['metadata'].get('namespace')}/{p['metadata'].get('name')}"
            for p in pods
        }
        for key in [k for k in self.owned if k not in listed]:
            self._forget(key)
        for pod in pods:
            self.apply(pod)

    # the API side -------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        headers, verify = {}, True
        token_file, ca_file = SA_DIR / "token", SA_DIR / "ca.crt"
        if token_file.is_file():
            headers["Authorization"] = f"Bearer {token_file.read_text().strip()}"
        if self.api_url.startswith("https://") and ca_file.is_file():
            verify = str(ca_file)
        return httpx.AsyncClient(
            base_url=self.api_url,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(30.0, read=WATCH_TIMEOUT_S + 30),
        )

    @property
    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    async def list_and_watch(self) -> None:
        """One list, then watches until an error; returns normally only on a 410 (relist)."""
        async with self._client() as client:
            resp = await client.get(self._path, params={"labelSelector": self.selector})
            resp.raise_for_status()
            body = resp.json()
            self.sync(body.get("items") or [])
            version = (body.get("metadata") or {}).get("resourceVersion")
            while True:
                params = {
                    "labelSelector": self.selector,
                    "watch": "true",
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": str(WATCH_TIMEOUT_S),
                }
                if version:
                    params["resourceVersion"] = version
                async with client.stream("GET", self._path, params=params) as stream:
                    stream.raise_for_status()
                    async for line in stream.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":  # 410 Gone: our version is too old; list again
                            log.info("watch error %s; listing again", obj.get("message") or obj.get("code"))
                            return
                        version = (obj.get("metadata") or {}).get("resourceVersion") or version
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            self.apply(obj, deleted=kind == "DELETED")

    async def run(self) -> None:
        """Forever: list + watch; a failure is logged and retried after RETRY_S."""
        while True:
            try:
                await self.list_and_watch()
            except asyncio.CancelledError:
                raise
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.warning("kubernetes discovery: %s: %s; retrying in %.0f s", type(e).__name__, e, RETRY_S)
            await asyncio.sleep(RETRY_S)
