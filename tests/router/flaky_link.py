"""A flaky network link in front of one real instance: an HTTP proxy (uvicorn in a thread) that
forwards everything as it is (the internal token's challenge and proof included) and breaks the
decode streams of POST /v1/generate as a test plans, one plan per stream in arrival order:

    ("cut", k)    forwards k token lines, then drops the connection mid-body (a stream that breaks)
    ("lost", k)   forwards k token lines, then the instance's error event with "lost": true
    ("stall", k)  forwards k token lines, then goes silent and answers /health 503 until the
                  router closes the stream (an instance that hangs and fails its health check)

It records the events it forwarded per stream (`forwarded`): what the router received before the
fault. Nothing here imitates an instance: every answer the router gets comes from the real one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import contextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.reference import free_port

HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


class LinkCut(Exception):
    """Raised inside a streamed body: uvicorn drops the connection without ending the body."""


class FlakyLink:
    def __init__(self, target: str):
        self.target = target.rstrip("/")
        self.plan: list[tuple[str, int]] = []
        self.forwarded: list[list[dict]] = []  # per /v1/generate stream: the events passed on
        self.unhealthy = False
        self.client: httpx.AsyncClient | None = None

    def app(self) -> Starlette:
        async def forward(request: Request):
            if self.client is None:
                self.client = httpx.AsyncClient(timeout=None)
            if request.url.path == "/health" and self.unhealthy:
                return JSONResponse({"error": {"message": "flaky link: stalled"}}, status_code=503)
            # Host as the router sent it: the instance's proof of the internal token covers it
            headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
            upstream = self.client.build_request(
                request.method,
                self.target + request.url.path,
                params=request.query_params,
                content=await request.body(),
                headers=headers,
            )
            resp = await self.client.send(upstream, stream=True)
            out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP | {"host"}}
            if request.url.path != "/v1/generate" or resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                return Response(content, resp.status_code, headers=out)
            plan = self.plan.pop(0) if self.plan else (None, 0)
            events: list[dict] = []
            self.forwarded.append(events)
            return StreamingResponse(self._lines(request, resp, plan, events), headers=out)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])

    async def _lines(
        self, request: Request, resp: httpx.Response, plan: tuple[str | None, int], events: list
    ):
        mode, after = plan
        tokens = 0
        try:
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if mode is not None and tokens >= after:
                    if mode == "cut":
                        raise LinkCut("flaky link: cut")
                    if mode == "lost":
                        yield (
                            json.dumps({"error": "flaky link: lost", "request_id": "x", "lost": True}) + "\n"
                        )
                        return
                    self.unhealthy = True  # "stall": until the router gives up on the stream
                    deadline = time.monotonic() + 60
                    while not await request.is_disconnected() and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    return
                event = json.loads(line)
                events.append(event)
                tokens += "token" in event
                yield line + "\n"
        finally:
            self.unhealthy = False
            await resp.aclose()

    def tokens(self, stream: int, index: int = 0) -> list[int]:
        """The token ids of choice `index` that stream number `stream` forwarded."""
        return [e["token"] for e in self.forwarded[stream] if "token" in e and e.get("index", 0) == index]


@contextmanager
def flaky_link(target: str):
    """A FlakyLink in front of `target`, served until the block ends; yields (link, its URL)."""
    import uvicorn

    link, port = FlakyLink(target), free_port()
    server = uvicorn.Server(uvicorn.Config(link.app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the flaky link did not start"
        time.sleep(0.05)
    try:
        yield link, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
