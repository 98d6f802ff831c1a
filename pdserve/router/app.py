"""The router's FastAPI app: OpenAI-compatible API in front of prefill and decode instances.

GET  /live                 200 while the process runs
GET  /health               200 when at least one prefill and one decode instance are usable, else 503
GET  /v1/models            the one served model
POST /v1/completions       prompt (string or token ids), sampling fields, stop strings, stream (SSE)
POST /v1/chat/completions  messages rendered with the checkpoint's chat template
GET  /metrics              Prometheus text (metrics.py); behind the API keys when there are some
/admin/...                 topology admin API, bearer token (admin.py)

With --discovery k8s the instances also come and go with the pods of a label selector (discovery.py).

A request: body size limit (413) -> validate (400 naming the field) -> tokenize off the event loop
with byte and token limits (prompt.py) -> check that some decode instance can ever hold prompt +
max_tokens (400) and that instances are up (503) -> Orchestrator.generate (admission: wait for an
instance with room or 429; pair, room, both halves, retries; the whole request within
--request-timeout, else 504) -> respond.py (text per choice, stop strings, tool calls) -> JSON or SSE. A
streaming request waits for its first piece of text before the 200 goes out, so a request that
fails before any token still gets a proper status code; after it, any failure is an SSE error
event. An unexpected exception is a 500 with an error id (the traceback is logged under it). A
client that goes away cancels the request: both halves abort.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..model.tokenizer import Tokenizer
from ..serving.http_edge import PRINCIPAL_SCOPE_KEY, install_edge
from ..serving.http_server import server_config
from . import protocol as P
from . import respond as R
from .admin import admin_router
from .chat import ChatShaper
from .config import RouterConfig
from .instance_auth import AllowedHosts, InstanceAuth
from .metrics import Metrics
from .orchestrator import Orchestrator
from .pool import NoInstance, Pool, TooLong
from .prompt import PromptLimits, chat_prompt, completion_prompt
from .structured import check_choices_grammar, response_grammar
from .tenants import cache_namespace
from .tools import forced_grammar, plan_tools, prompt_opens_reasoning

DISCONNECT_POLL_S = 0.5
log = logging.getLogger("pdserve.router")


class RouterState:
    """Everything the routes share; built in the lifespan (the http client lives as long as the app)."""

    def __init__(self, cfg: RouterConfig, client: httpx.AsyncClient):
        self.cfg, self.client = cfg, client
        self.tokenizer = Tokenizer.from_pretrained(cfg.model)
        self.model_type = _model_type(cfg.model)  # picks the tool-call and reasoning markup
        self.pool = Pool(
            cfg.prefill,
            cfg.decode,
            cfg.policy,
            cfg.max_in_flight,
            cfg.cache_balance_threshold,
            client.auth if isinstance(client.auth, InstanceAuth) else None,
            AllowedHosts(cfg.allowed_instance_hosts),
        )
        self.metrics = Metrics()
        self.metrics.cache_aware = self.pool.cache_aware
        self.orch = Orchestrator(
            self.pool,
            client,
            self.metrics,
            cfg.max_attempts,
            cfg.retry_backoff_s,
            cfg.instance_timeout_s,
            cfg.max_queue,
            cfg.max_migrations,
            tuple(self.tokenizer.eos_token_ids),
            cfg.migration_wait_s,
        )
        self.metrics.queued = lambda: self.orch.queued
        self.metrics.instances = lambda: list(self.pool.instances.values())
        self.limits = PromptLimits(cfg.max_prompt_bytes, cfg.max_prompt_tokens)


def _model_type(model_dir) -> str | None:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return None


def create_app(cfg: RouterConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(cfg.instance_timeout_s, connect=cfg.connect_timeout_s)
        auth = InstanceAuth(cfg.internal_token) if cfg.internal_token else None  # only to proven instances
        async with httpx.AsyncClient(limits=limits, timeout=timeout, auth=auth) as client:
            state = app.state.router = RouterState(cfg, client)
            await state.pool.poll_all(client)
            tasks = [asyncio.create_task(state.pool.health_loop(client, cfg.health_interval_s))]
            if cfg.discovery == "k8s":
                tasks.append(asyncio.create_task(_discovery(cfg, state).run()))
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()

    # behind API keys the API's map (/docs, /redoc, /openapi.json) is not served: it would be open
    docs = {} if not cfg.api_keys else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pdserve router", lifespan=lifespan, **docs)
    _add_error_handlers(app, cfg.max_body_bytes, cfg.api_keys)
    app.include_router(admin_router(cfg.admin_token))

    @app.get("/live")
    def live():
        return {"status": "ok"}

    @app.get("/health")
    def health(request: Request):
        pool = request.app.state.router.pool
        if pool.ready():
            return {"status": "ok"}
        down = [i.role for i in pool.instances.values() if i.usable]
        missing = [r for r in ("prefill", "decode") if r not in down]
        return JSONResponse(
            {"status": "unavailable", "error": f"no usable {' or '.join(missing)} instance"}, status_code=503
        )

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pdserve"}],
        }

    @app.get("/metrics")
    async def metrics(request: Request):
        state = request.app.state.router
        await state.pool.poll_all(state.client)  # per-instance gauges as of now, not of the last tick
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        state: RouterState = request.app.state.router
        _check_model(cfg, body.model)
        prompt = await completion_prompt(state.tokenizer, body.prompt, state.limits)
        return await _serve(state, request, body, prompt, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatRequest, request: Request):
        state: RouterState = request.app.state.router
        _check_model(cfg, body.model)
        plan = plan_tools(body.tools, body.tool_choice, state.model_type)
        kwargs = {**P.template_kwargs(body), **plan.template_kwargs()}
        prompt, text = await chat_prompt(state.tokenizer, body.messages, state.limits, **kwargs)
        in_reasoning = prompt_opens_reasoning(text)
        forced = forced_grammar(plan, in_reasoning)
        shapers = partial(ChatShaper, plan, in_reasoning)  # one per choice
        return await _serve(state, request, body, prompt, True, shapers, forced)

    return app


def _discovery(cfg: RouterConfig, state: RouterState):
    from .discovery import K8sDiscovery

    polls: set[asyncio.Task] = set()

    def poll_now(inst):  # usable at once, not after the next tick; a slow peer does not hold up the watch
        task = asyncio.create_task(state.pool.poll(state.client, inst))
        polls.add(task)
        task.add_done_callback(polls.discard)

    return K8sDiscovery(state.pool, cfg.selector, cfg.namespace, cfg.k8s_api, on_added=poll_now)


def _add_error_handlers(app: FastAPI, max_body_bytes: int, api_keys: dict[str, str] | None) -> None:
    install_edge(app, max_body_bytes, tokens=api_keys, protect=_protected)

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, exc: P.ApiError):
        return exc.response()


def _protected(path: str) -> bool:
    """Paths that need an API key (when there are some): the OpenAI API and the metrics, whose
    prefix-cache hit counters would otherwise tell anyone what others' prompts hit."""
    return path.startswith("/v1/") or path == "/metrics"


def _namespace(cfg: RouterConfig, request: Request, body) -> str:
    """The request's prefix-cache namespace (tenants.py): its principal, narrowed by the trusted
    gateway header (only with --namespace-header) and by its own cache_salt."""
    header = request.headers.get(cfg.namespace_header) if cfg.namespace_header else None
    return cache_namespace(request.scope.get(PRINCIPAL_SCOPE_KEY), header, body.cache_salt)


def _check_model(cfg: RouterConfig, model: str) -> None:
    if model != cfg.model_name:
        raise P.ApiError(
            404,
            f"the model {model!r} does not exist; this router serves {cfg.model_name!r}",
            "model",
            "model_not_found",
        )


async def _serve(
    state: RouterState,
    request: Request,
    body,
    prompt: list[int],
    chat: bool,
    make_shaper=None,
    tool_grammar: str | None = None,
):
    """make_shaper: () -> a chat choice's ChatShaper (reasoning / content / tool calls); tool_grammar:
    a forced tool call's."""
    try:
        sampling = P.check_sampling(body, state.cfg.default_max_tokens, state.tokenizer.vocab_size)
        P.check_response_budget(sampling, body.stream, state.cfg.max_response_budget)
        params = dataclasses.replace(
            sampling,
            grammar=await response_grammar(body.response_format, tool_grammar),
            cache_namespace=_namespace(state.cfg, request, body),
        )
        if params.grammar is not None and params.ignore_eos:
            raise P.ApiError(400, "ignore_eos cannot be combined with response_format", "ignore_eos")
        check_choices_grammar(params.grammar, params.n)
        state.orch.check_fits(len(prompt), params.max_tokens, params.n)
    except P.ApiError:
        state.metrics.finished("client_error")
        raise
    except TooLong as e:
        state.metrics.finished("client_error")
        raise P.ApiError(400, str(e), "prompt", "context_length_exceeded") from None
    except NoInstance as e:
        state.metrics.finished("unavailable")
        raise P.ApiError(503, str(e)) from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    deadline = time.monotonic() + state.cfg.request_timeout_s
    counts = R.Counts()
    stream = R.pieces(state, prompt, params, body.stop_list(), deadline, getattr(body, "echo", False), counts)
    if not body.stream:
        return await _until_disconnect(
            request, R.collect(state, rid, make_shaper, body, prompt, stream, params.n, counts)
        )
    # errors before any token keep their status
    first = await _until_disconnect(request, R.first_piece(stream))
    return StreamingResponse(
        R.sse(state, rid, make_shaper, body, len(prompt), first, stream, params.n, counts),
        media_type="text/event-stream",
    )


async def _until_disconnect(request: Request, coro):
    """Runs `coro`; if the client goes away first, cancels it (which aborts the request's halves)."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise P.ApiError(499, "the client closed the request")
    finally:
        task.cancel()


def make_server(cfg: RouterConfig):
    """The router's uvicorn.Server on cfg.host:cfg.port (serving/http_server.py: its keep-alive)."""
    import uvicorn

    return uvicorn.Server(server_config(create_app(cfg), cfg.host, cfg.port))


def serve(cfg: RouterConfig) -> None:
    server = make_server(cfg)
    server.run()
    if not server.started:  # the port was taken, the lifespan failed: as uvicorn.run does
        raise SystemExit(3)
