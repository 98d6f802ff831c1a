"""Every server keeps an idle connection open longer than its clients keep it for reuse.

A server that closes an idle connection just as a client sends on it loses that request: the client
reads EOF, not an answer. httpx (the router's client of the instances, and the tests') reuses a
connection idle up to 5 s, uvicorn's own default keep-alive; here each server must still answer on a
connection left idle past httpx's expiry.
"""

from __future__ import annotations

import socket
import time

import httpx

from tests.router.helpers import router_config, running_router

REQUEST = b"GET /health HTTP/1.1\r\nHost: pdserve\r\n\r\n"


def _answer(sock: socket.socket) -> bytes:
    """One HTTP/1.1 response (its headers and Content-Length body), or what came before EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_servers_outlast_the_clients_keep_alive(model_dir, instances):
    p_url, d_url = instances
    with running_router(router_config(model_dir, p_url, d_url)) as (url, _):
        socks = {}
        for base in (url, p_url, d_url):
            host, port = base.removeprefix("http://").split(":")
            socks[base] = socket.create_connection((host, int(port)), timeout=30)
            socks[base].sendall(REQUEST)
            assert _answer(socks[base]).startswith(b"HTTP/1.1 200"), base
        time.sleep(httpx.Limits().keepalive_expiry + 1.5)  # past httpx's reuse window (and uvicorn's default)
        for base, sock in socks.items():
            sock.sendall(REQUEST)  # on the same, idle connection
            answer = _answer(sock)
            sock.close()
            assert answer.startswith(b"HTTP/1.1 200"), (base, answer[:200])
