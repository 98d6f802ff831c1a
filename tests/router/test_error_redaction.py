"""No topology in error bodies (issue 40 item 7): a client never reads an instance's address, nor
the addresses an instance's own error names (its side channel, its NIXL peers); the router's log
keeps the whole text under the error id the client gets. Real HTTP stand-ins for the instances
prove the internal token and fail every request with an error full of addresses."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from pdserve.router.redact import redact
from pdserve.serving.auth import CHALLENGE_HEADER, PROOF_HEADER, token_proof
from tests.router.helpers import router_config, running_router, wait_until
from tests.servers import TEST_TOKEN

LEAK = (
    "NIXL connect to tcp://10.9.8.7:41234 failed; side channel prefill-0.pdserve.svc:5557, peer [fd00::7]:9"
)


@pytest.mark.parametrize(
    "text, kept",
    [
        ("prefill http://10.0.0.5:8001: HTTP 500: boom", "prefill <instance>: HTTP 500: boom"),
        ("decode http://[fe80::1%eth0]:8001: lost", "decode <instance>: lost"),
        ("at node-3.svc:8001, localhost:9000 and fe80::1:2:3", "at <instance>, <instance> and <instance>"),
        ("https://user:pw@host/x?y=1 (tcp://h:1).", "<instance> (<instance>)."),
        ("10.1.2.3 refused", "<instance> refused"),
        ("failed after 3 tries: choice 3 of 4, room r-12", "failed after 3 tries: choice 3 of 4, room r-12"),
    ],
)
def test_redact_replaces_every_address(text, kept):
    assert redact(text) == kept


def test_redact_bounds_what_it_reads():
    assert len(redact("a" * 10_000_000)) == 1000  # an instance's text may be anything


class FailingInstance:
    """Proves the internal token, reports room, and answers every POST 500 with LEAK."""

    def __init__(self, role: str):
        side = {"bootstrap": "tcp://127.0.0.1:5557"} if role == "prefill" else {}

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict, proof: str | None = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                if proof:
                    self.send_header(PROOF_HEADER, proof)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                nonce = self.headers.get(CHALLENGE_HEADER)
                proof = token_proof(TEST_TOKEN, nonce, self.headers.get("host", "")) if nonce else None
                if self.path == "/health":
                    self._answer(200, {"status": "ok"}, proof)
                else:  # /info (a prefill's, with its side channel), /capacity
                    self._answer(200, {"total_tokens": 100_000, "free_tokens": 100_000, **side})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._answer(500, {"error": {"message": LEAK, "type": "internal_error"}})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_failed_request_names_no_address_and_the_log_has_them(model_dir, caplog):
    prefill, decode = FailingInstance("prefill"), FailingInstance("decode")
    try:
        cfg = router_config(model_dir, prefill.url, decode.url, max_attempts=2, health_interval_s=0.2)
        with running_router(cfg) as (url, _), caplog.at_level(logging.WARNING, "pdserve.router"):
            wait_until(
                lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, "both instances proven"
            )
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2},
                timeout=60,
            )
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        for address in (
            "127.0.0.1",
            str(prefill.server.server_address[1]),
            str(decode.server.server_address[1]),
        ):
            assert address not in message, message
        for secret in ("10.9.8.7", "41234", "pdserve.svc", "fd00::7"):
            assert secret not in message, message
        assert "failed after 2 tries" in message and "<instance>" in message
        error_id = message.split("error id ")[1].split(";")[0]
        logged = [rec.getMessage() for rec in caplog.records if error_id in rec.getMessage()]
        joined = " ".join(logged)  # whichever half failed last is named (both race to fail first)
        assert logged and "10.9.8.7:41234" in joined and (prefill.url in joined or decode.url in joined)
    finally:
        prefill.close()
        decode.close()
