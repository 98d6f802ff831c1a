"""What every HTTP edge shares (router and instances alike; docs/design.md invariants 9 and 11). Torch-free.

- OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, for bad bodies (400,
  naming the field), HTTPExceptions, oversized bodies (413) and unexpected failures (500 with an
  error id; the traceback goes to the log under that id, never to the client).
- A request body size limit, checked before anything parses the body.
- `StrictModel`: the pydantic base of request bodies; non-finite numbers are refused.
- Bearer authentication (`RequireBearer`): an instance requires the internal token on every path
  but /health and /live; the router, with API keys, requires one of them on /v1/* and /metrics and
  leaves the key's name (the principal) in the ASGI scope under PRINCIPAL_SCOPE_KEY.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from .auth import CHALLENGE_HEADER, MAX_NONCE_CHARS, PROOF_HEADER, bearer_principal, token_proof
from .instance_loop import Unavailable
from .watchdog import add_health_route

log = logging.getLogger("pdserve.http")

DEFAULT_MAX_BODY_BYTES = 16 << 20
REQUEST_ID = r"^[A-Za-z0-9._:-]{1,128}$"  # request ids and rooms: no paths, spaces or control characters


class StrictModel(BaseModel):
    """Request bodies: unknown fields ignored, NaN and infinities refused (JSON allows neither)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


RETRY_AFTER_S = 1  # what a 429 tells the client to wait


def too_busy(message: str) -> StarletteHTTPException:
    """The 429 an edge answers when its queue is full (with Retry-After)."""
    return StarletteHTTPException(429, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def new_error_id() -> str:
    return uuid.uuid4().hex[:12]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    if status == 503:
        return "service_unavailable"
    return "invalid_request_error" if status < 500 else "server_error"


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(message, error_type(status), param, code), status_code=status, headers=headers
    )


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, the first bad field) of a body that failed validation."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}", None
    text = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in errors[:5])
    return text or "invalid request body", param


OPEN_PATHS = ("/health", "/live")  # probes: no secret in a kubelet's config
PRINCIPAL_SCOPE_KEY = "pdserve.principal"  # the authenticated key's name, in the request's ASGI scope


def install_edge(
    app: FastAPI,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    token: str | None = None,
    protect: Callable[[str], bool] = lambda path: path not in OPEN_PATHS,
    tokens: dict[str, str] | None = None,
) -> None:
    """Error handlers, the body size limit and, with `token` (or several: `tokens`, {token: its
    principal's name}), bearer authentication of the paths `protect` selects (every one but the
    probes, by default)."""

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):  # 400, not FastAPI's 422
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code >= 500:  # a server-side failure: the id finds its log line (and any traceback)
            error_id = new_error_id()
            log.error("error %s on %s %s: %s", error_id, request.method, request.url.path, message)
            message = f"{message} (error id {error_id})"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        error_id = new_error_id()
        log.error("error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal error (error id {error_id})")

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if token is not None:
        tokens = {**(tokens or {}), token: "internal"}
    if tokens:  # outermost: nothing of an unauthenticated request is read
        app.add_middleware(RequireBearer, tokens=tokens, protect=protect)


class RequireBearer:
    """ASGI middleware: 401 with an OpenAI error body unless `Authorization: Bearer <token>` with one
    of `tokens` ({token: name}); the name goes into the scope (PRINCIPAL_SCOPE_KEY)."""

    def __init__(self, app, tokens: dict[str, str], protect: Callable[[str], bool]):
        self.app, self.tokens, self.protect = app, dict(tokens), protect

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.protect(scope["path"]):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            principal = bearer_principal(header, self.tokens)
            scope[PRINCIPAL_SCOPE_KEY] = principal
            if principal is None:
                response = error_response(
                    401,
                    "missing or invalid bearer token",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class AnswerChallenge:
    """ASGI middleware of an instance: a request with `X-PDServe-Challenge: <nonce>` gets
    `X-PDServe-Proof` in its answer (serving/auth.py token_proof), so that the router sends the
    internal token only to a server that holds it (router/instance_auth.py)."""

    def __init__(self, app, token: str):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        nonce = headers.get(CHALLENGE_HEADER.encode(), b"").decode("latin-1")
        if not 0 < len(nonce) <= MAX_NONCE_CHARS:
            return await self.app(scope, receive, send)
        proof = token_proof(self.token, nonce, headers.get(b"host", b"").decode("latin-1")).encode()

        async def send_proved(message):
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (PROOF_HEADER.encode(), proof)],
                }
            await send(message)

        await self.app(scope, receive, send_proved)


class BodyLimit:
    """ASGI middleware: reads a request's body up to `max_bytes` (413 beyond), then replays it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        response = error_response(413, f"the request body exceeds {self.max_bytes} bytes")
        await response(scope, receive, send)


def instance_app(title: str, token: str | None, dead_rank, drain=None) -> FastAPI:
    """The FastAPI app of a prefill or decode instance, with what both roles answer alike: the edge
    (install_edge, `token` required but on /health and /live), GET /health (watchdog.add_health_route:
    503 naming a dead rank, or draining) and GET /live (200 while the HTTP server runs)."""
    app = FastAPI(title=title)
    install_edge(app, token=token)
    if token is not None:
        app.add_middleware(AnswerChallenge, token=token)
    add_health_route(app, dead_rank, drain and (lambda: drain.draining))

    @app.get("/live")
    def live():
        return {"status": "ok"}

    return app


def add_flush_route(app: FastAPI, loop, flush: Callable[[], int]) -> None:
    """POST /flush_cache -> {"flushed_tokens"} (contracts.FlushReply): flush() -- the prefix cache's
    unreferenced pages go back to the free pool -- runs on the instance's loop thread, which alone
    owns the instance (serving/instance_loop.py `call`); 503 once the loop has stopped."""

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        try:
            return {"flushed_tokens": int(await asyncio.wrap_future(loop.call(flush)))}
        except Unavailable as e:
            raise StarletteHTTPException(503, str(e)) from None


def refuse_if_draining(drain) -> None:
    """A new request while the instance drains: 503 naming another instance as the way out."""
    if drain is not None and drain.draining:
        raise StarletteHTTPException(503, drain.refusal())
