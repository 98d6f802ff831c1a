"""The uvicorn config of every pdserve server (router and instances). Torch-free.

A server that closes an idle keep-alive connection just as a client sends on it loses that request:
the client reads EOF, not an answer. uvicorn's 5 s default equals httpx's keep-alive expiry (the
router's client of the instances), so a busy router lost a request now and then. A server must
keep an idle connection longer than any client of it reuses one (httpx: 5 s; load balancers: 60 s).
"""

from __future__ import annotations

KEEP_ALIVE_S = 75


def server_config(app, host: str, port: int, **options):
    """uvicorn.Config of a pdserve server: KEEP_ALIVE_S, warnings only, unless `options` say otherwise."""
    import uvicorn

    options = {"log_level": "warning", "timeout_keep_alive": KEEP_ALIVE_S, **options}
    return uvicorn.Config(app, host=host, port=port, **options)
