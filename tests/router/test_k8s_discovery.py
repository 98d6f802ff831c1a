"""`pdserve router --discovery k8s`: a real router process against a stand-in Kubernetes API server
(a real HTTP server in this process that serves pod lists and a newline-delimited watch stream).
Instances appear in `pdserve admin topology --json` as Ready pods are added and disappear when
they are deleted or turn unready; pods outside the selector, without a role or not Ready never
appear; after a watch ERROR (410 Gone) the router lists again and drops what went missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from tests.reference import free_port

NS, TOKEN = "serving", "k8s-admin-test-token-4e9b2a71"
SELECTOR = "app.kubernetes.io/part-of=pdserve"


def pod(name: str, role: str | None, port: int, ready: bool = True, labels: dict | None = None) -> dict:
    lab = {"app.kubernetes.io/part-of": "pdserve", **(labels or {})}
    if role:
        lab["pdserve.io/role"] = role
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "labels": lab,
            "annotations": {"pdserve.io/port": str(port)},
        },
        "status": {
            "podIP": "127.0.0.1",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApi:
    """Pods of one namespace with a resourceVersion per change; watches get every later event."""

    def __init__(self):
        self.pods: dict[str, dict] = {}
        self.events: list[tuple[int, dict]] = []  # (version, event)
        self.version = 1
        self.cond = threading.Condition()
        self.requests: list[str] = []  # paths + queries seen, for the selector check
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                api.requests.append(self.path)
                if url.path != f"/api/v1/namespaces/{NS}/pods":
                    self.send_error(404)
                    return
                if q.get("watch") == "true":
                    api.serve_watch(self, int(q.get("resourceVersion", "0")), q.get("labelSelector", ""))
                    return
                with api.cond:
                    items = [p for p in api.pods.values() if matches(p, q.get("labelSelector", ""))]
                    body = json.dumps(
                        {"kind": "PodList", "metadata": {"resourceVersion": str(api.version)}, "items": items}
                    ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.closed = False
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve_watch(self, handler, since: int, selector: str) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()  # HTTP/1.0: the stream ends when the connection closes
        sent = since
        while not self.closed:
            with self.cond:
                todo = [(v, e) for v, e in self.events if v > sent]
                if not todo:
                    self.cond.wait(0.2)
                    continue
            for v, e in todo:
                sent = v
                if e["type"] != "ERROR" and not matches(e["object"], selector):
                    continue
                handler.wfile.write((json.dumps(e) + "\n").encode())
                handler.wfile.flush()
                if e["type"] == "ERROR":
                    return

    def _event(self, kind: str, obj: dict) -> None:
        self.version += 1
        if kind != "ERROR":
            obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, {"type": kind, "object": obj}))
        self.cond.notify_all()

    def put(self, p: dict) -> None:
        with self.cond:
            kind = "MODIFIED" if p["metadata"]["name"] in self.pods else "ADDED"
            self.pods[p["metadata"]["name"]] = p
            self._event(kind, p)

    def delete(self, name: str) -> None:
        with self.cond:
            self._event("DELETED", self.pods.pop(name))

    def expire(self, silently_deleted: str) -> None:
        """A pod vanishes without an event, and watchers get 410 Gone: only a new list shows it."""
        with self.cond:
            del self.pods[silently_deleted]
            self.version += 1
            self._event("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"})

    def close(self):
        self.closed = True
        self.server.shutdown()


def matches(p: dict, selector: str) -> bool:
    labels = p["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, _, v in (t.partition("=") for t in selector.split(",") if t))


@pytest.fixture
def api():
    a = FakeApi()
    yield a
    a.close()


def topology(router_url: str) -> dict | None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "admin",
            "--router",
            router_url,
            "--token",
            TOKEN,
            "topology",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        return None
    return {row["url"]: row["role"] for row in json.loads(out.stdout)["instances"]}


def wait_topology(router_url: str, predicate, what: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        topo = topology(router_url)
        if topo is not None and predicate(topo):
            return topo
        assert time.monotonic() < deadline, f"timed out waiting for {what}; topology {topo}"
        time.sleep(0.1)


def test_router_follows_pods(api, tiny_checkpoints):
    model = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    ports = {name: free_port() for name in ("p0", "p1", "d0", "other", "router-pod", "static")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    api.put(pod("p0", "prefill", ports["p0"]))
    api.put(pod("d0", "decode", ports["d0"], ready=False))  # not Ready: not registered yet
    api.put(pod("router-pod", None, ports["router-pod"]))  # matches the selector, has no role
    api.put(pod("other", "decode", ports["other"], labels={"app.kubernetes.io/part-of": "someone-else"}))

    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "router",
            "--model",
            str(model),
            "--port",
            str(port),
            "--admin-token",
            TOKEN,
            "--health-interval",
            "0.5",
            "--decode",
            url["static"],
            "--discovery",
            "k8s",
            "--selector",
            SELECTOR,
            "--namespace",
            NS,
            "--k8s-api",
            api.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PDSERVE_ADMIN_TOKEN": ""},
    )
    try:
        # the initial list: only the Ready prefill pod (plus the static decode URL)
        topo = wait_topology(router_url, lambda t: url["p0"] in t, "p0 from the first list")
        assert topo == {url["p0"]: "prefill", url["static"]: "decode"}, topo
        selectors = {parse_qs(urlparse(r).query).get("labelSelector", [None])[0] for r in api.requests}
        assert selectors == {SELECTOR}, selectors  # the list and every watch ask for the selector

        # watch events: a new Ready pod appears; the unready one stays out until it is Ready
        api.put(pod("p1", "prefill", ports["p1"]))
        topo = wait_topology(router_url, lambda t: url["p1"] in t, "p1 added by a watch event")
        assert url["d0"] not in topo and url["other"] not in topo and url["router-pod"] not in topo
        api.put(pod("d0", "decode", ports["d0"], ready=True))
        topo = wait_topology(router_url, lambda t: url["d0"] in t, "d0 once Ready")
        assert topo[url["d0"]] == "decode"

        # deleted and unready pods disappear; the static instance stays
        api.delete("p0")
        wait_topology(router_url, lambda t: url["p0"] not in t, "p0 removed after DELETED")
        api.put(pod("d0", "decode", ports["d0"], ready=False))
        topo = wait_topology(router_url, lambda t: url["d0"] not in t, "d0 removed when unready")
        assert topo == {url["p1"]: "prefill", url["static"]: "decode"}, topo

        # 410 Gone: the router lists again; a pod that vanished meanwhile is dropped, a new one added
        api.expire(silently_deleted="p1")
        api.put(pod("d0", "decode", ports["d0"], ready=True))
        topo = wait_topology(router_url, lambda t: url["p1"] not in t and url["d0"] in t, "relist after 410")
        assert topo == {url["d0"]: "decode", url["static"]: "decode"}, topo
        assert proc.poll() is None
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "Traceback" not in out, out
