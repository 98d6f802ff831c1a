"""The admin token does not yield the internal token (issue 40 item 5): `/admin/add` of a listener
outside the allowed instance hosts is refused before anything is sent to it; a listener inside them
that cannot prove it holds the internal token (no proof, or one made with another token) is not
added and never receives the token, however long the router runs; one that proves it is added and
only then gets the token. Real HTTP listeners on loopback addresses record every header they get."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.serving.auth import CHALLENGE_HEADER, PROOF_HEADER, token_proof
from tests.reference import free_port
from tests.router.helpers import router_config, running_router, wait_until
from tests.servers import TEST_TOKEN

ADMIN = "admin-token-for-instance-auth-3f9a7c"
OTHER_TOKEN = "some-other-internal-token-51c0e8a2"


class Listener:
    """An HTTP server on `host` that answers 200 {} to everything and records each request's
    (path, headers); with `proof_token` it answers challenges as an instance holding that token."""

    def __init__(self, host: str, proof_token: str | None = None):
        seen: list[tuple[str, dict]] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                headers = {k.lower(): v for k, v in self.headers.items()}
                seen.append((self.path, headers))
                body = json.dumps({"status": "ok"}).encode()
                self.send_response(200)
                nonce = headers.get(CHALLENGE_HEADER)
                if proof_token and nonce:
                    self.send_header(PROOF_HEADER, token_proof(proof_token, nonce, headers.get("host", "")))
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.seen = seen
        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def got_token(self) -> bool:
        return any(TEST_TOKEN in " ".join(h.values()) for _, h in self.seen)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def router(model_dir):
    """A router with the tests' internal token whose startup instances are on 127.0.0.1 (nothing
    listens there: they stay unhealthy), polling every 0.2 s."""
    p, d = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    return router_config(model_dir, p, d, admin_token=ADMIN, health_interval_s=0.2)


def add(url: str, instance: str) -> httpx.Response:
    return httpx.post(
        f"{url}/admin/add",
        json={"role": "prefill", "url": instance},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )


def topology(url: str) -> list[str]:
    r = httpx.get(f"{url}/admin/topology", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    return [row["url"] for row in r.json()["instances"]]


def five_health_rounds(app) -> None:
    """Waits until the router polled every instance five more times (a listener it had kept would
    have been asked by now)."""
    pool = app.state.router.pool
    start = pool.health_rounds
    wait_until(lambda: pool.health_rounds >= start + 5, "five health rounds of the router", 10, 0.02)


def test_admin_add_outside_the_allowed_hosts_never_reaches_the_listener(router):
    listener = Listener("127.0.0.2")  # allowed: 127.0.0.1 only (the startup instances' host)
    try:
        with running_router(router) as (url, app):
            r = add(url, listener.url)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["code"] == "host_not_allowed" and "127.0.0.2" in err["message"]
            five_health_rounds(app)
            assert listener.url not in topology(url)
        assert listener.seen == [] and not listener.got_token()
    finally:
        listener.close()


@pytest.mark.parametrize("proof_token", [None, OTHER_TOKEN], ids=["no-proof", "wrong-token"])
def test_a_listener_that_cannot_prove_the_token_is_not_added_and_never_gets_it(router, proof_token):
    listener = Listener("127.0.0.1", proof_token)  # an allowed host
    try:
        with running_router(router) as (url, app):
            r = add(url, listener.url)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["code"] == "instance_not_proven" and "internal token" in err["message"]
            assert listener.url not in topology(url)
            five_health_rounds(app)
        assert [path for path, _ in listener.seen] == ["/health"]  # the challenge, and nothing after
        assert CHALLENGE_HEADER in listener.seen[0][1] and not listener.got_token()
    finally:
        listener.close()


def test_an_allowed_listener_that_proves_the_token_gets_it_only_after_the_proof(model_dir, router):
    """--allowed-instance-hosts 127.0.0.2 admits the host; the proof admits the instance."""
    listener = Listener("127.0.0.2", TEST_TOKEN)
    try:
        cfg = router_config(
            model_dir,
            router.prefill[0],
            router.decode[0],
            admin_token=ADMIN,
            allowed_instance_hosts=("127.0.0.2",),
        )
        with running_router(cfg) as (url, _):
            assert add(url, listener.url).status_code == 200
            wait_until(listener.got_token, "the proven instance's load poll with the token")
        challenged = [h for _, h in listener.seen if CHALLENGE_HEADER in h]
        assert challenged and all("authorization" not in h for h in challenged)
        first = next(i for i, (_, h) in enumerate(listener.seen) if "authorization" in h)
        assert CHALLENGE_HEADER in listener.seen[first - 1][1]  # right after a proven challenge
    finally:
        listener.close()


BAD_URLS = [
    "http://127.0.0.1:99999",  # a port no client can connect to
    "http://127.0.0.1:" + "9" * 100,
    "http://127.0.0.1:1/\x00",
    "http://" + "a" * 10_000_000,  # a 10 MB URL
    "ftp://127.0.0.1:1",
    "http://",
]


def test_admin_add_of_an_unusable_url_is_a_400_and_the_router_keeps_serving(router):
    """Every URL a client could not connect to is refused at /admin/add with an OpenAI-style 400
    (they were 500s: an invalid URL raised in the host check, an out-of-range port in the poll),
    nothing is added, and the router still answers. Static instance URLs take the same rule."""
    with running_router(router) as (url, _):
        before = topology(url)
        for bad in BAD_URLS:
            r = add(url, bad)
            assert r.status_code == 400, (bad[:40], r.status_code, r.text[:200])
            assert r.json()["error"]["message"], bad[:40]
        assert topology(url) == before
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200
    for bad in BAD_URLS[:3]:
        with pytest.raises(ValueError, match="instance URL"):
            router_config(router.model, bad, f"http://127.0.0.1:{free_port()}")
