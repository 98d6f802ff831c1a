"""serving/http_edge.py on a small app: OpenAI error bodies, error ids instead of tracebacks, the
body size limit before parsing, non-finite numbers refused, bearer authentication."""

from __future__ import annotations

import logging

from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from pdserve.serving.http_edge import StrictModel, install_edge


class Body(StrictModel):
    x: float = 0.0


def make_client(token: str | None = None) -> TestClient:
    app = FastAPI()
    install_edge(app, max_body_bytes=1000, token=token)

    @app.post("/boom")
    def boom(body: Body):
        raise RuntimeError("secret internals")

    @app.post("/fail")
    def fail(body: Body):
        raise HTTPException(502, "the peer went away")

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return TestClient(app, raise_server_exceptions=False)


def test_server_errors_carry_an_id_and_never_a_traceback(caplog):
    client = make_client()
    with caplog.at_level(logging.ERROR, logger="pdserve.http"):
        r = client.post("/boom", json={"x": 1})
        f = client.post("/fail", json={})
    assert r.status_code == 500 and f.status_code == 502
    for resp in (r, f):
        message = resp.json()["error"]["message"]
        assert "error id " in message and "Traceback" not in resp.text and "secret internals" not in resp.text
        error_id = message.split("error id ")[1].rstrip(")")
        assert any(error_id in rec.getMessage() for rec in caplog.records), error_id
    assert any(rec.exc_info and "secret internals" in str(rec.exc_info[1]) for rec in caplog.records)


def test_bad_bodies_are_400s_naming_the_field_and_big_ones_413():
    client = make_client()
    for raw in ('{"x": NaN}', '{"x": Infinity}', '{"x": 1e999}', '{"x": "abc"}'):
        r = client.post("/fail", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x", (raw, r.text)
    r = client.post("/fail", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/fail", content=b"[" * 600 + b"]" * 600, headers={"content-type": "application/json"})
    assert r.status_code == 413  # over the 1000-byte limit before any parsing


def test_bearer_token_guards_all_but_the_probes():
    token = "edge-test-token-0b9c7d2e41"
    client = make_client(token)
    assert client.post("/fail", json={}).status_code == 401
    assert client.post("/fail", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.post("/fail", json={}, headers={"Authorization": f"Bearer {token}"}).status_code == 502
    assert client.get("/health").status_code == 200
