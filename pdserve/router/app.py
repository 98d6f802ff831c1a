"""The router's FastAPI app: OpenAI-compatible API in front of prefill and decode instances.

GET  /live                 200 while the process runs
GET  /health               200 when at least one prefill and one decode instance are usable, else 503
GET  /v1/models            the one served model
POST /v1/completions       prompt (string or token ids), sampling fields, stop strings, stream (SSE)
POST /v1/chat/completions  messages rendered with the checkpoint's chat template
GET  /metrics              Prometheus text (metrics.py)
/admin/...                 topology admin API, bearer token (admin.py)

With --discovery k8s the instances also come and go with the pods of a label selector (discovery.py).

A request: body size limit (413) -> validate (400 naming the field) -> tokenize off the event loop
with byte and token limits (prompt.py) -> check that some decode instance can ever hold prompt +
max_tokens (400) and that instances are up (503) -> Orchestrator.generate (admission: wait for an
instance with room or 429; pair, room, both halves, retries; the whole request within
--request-timeout, else 504) -> TextStream (incremental text, stop strings) -> JSON or SSE. A
streaming request waits for its first piece of text before the 200 goes out, so a request that
fails before any token still gets a proper status code; after it, any failure is an SSE error
event. An unexpected exception is a 500 with an error id (the traceback is logged under it). A
client that goes away cancels the request: both halves abort.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..contracts import PrefillReply
from ..engine.http_edge import RETRY_AFTER_S, install_edge, new_error_id
from ..model.tokenizer import Tokenizer
from . import protocol as P
from .admin import admin_router
from .chat import ChatShaper
from .config import RouterConfig
from .logprobs import LogprobFormatter
from .logprobs import merge as merge_logprobs
from .metrics import Metrics
from .orchestrator import BadRequest, DeadlineExceeded, GenParams, Orchestrator, Overloaded, RequestFailed
from .pool import NoInstance, Pool, TooLong
from .prompt import PromptLimits, chat_prompt, completion_prompt
from .structured import response_grammar
from .text import TextStream
from .tools import forced_grammar, plan_tools, prompt_opens_reasoning

DISCONNECT_POLL_S = 0.5
log = logging.getLogger("pdserve.router")


class RouterState:
    """Everything the routes share; built in the lifespan (the http client lives as long as the app)."""

    def __init__(self, cfg: RouterConfig, client: httpx.AsyncClient):
        self.cfg, self.client = cfg, client
        self.tokenizer = Tokenizer.from_pretrained(cfg.model)
        self.model_type = _model_type(cfg.model)  # picks the tool-call and reasoning markup
        self.pool = Pool(cfg.prefill, cfg.decode, cfg.policy, cfg.max_in_flight)
        self.metrics = Metrics()
        self.orch = Orchestrator(
            self.pool,
            client,
            self.metrics,
            cfg.max_attempts,
            cfg.retry_backoff_s,
            cfg.instance_timeout_s,
            cfg.max_queue,
        )
        self.metrics.queued = lambda: self.orch.queued
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
        headers = {"Authorization": f"Bearer {cfg.internal_token}"} if cfg.internal_token else {}
        async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
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

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    _add_error_handlers(app, cfg.max_body_bytes, cfg.api_key)
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
        return PlainTextResponse(
            state.metrics.render(state.pool.instances.values()), media_type="text/plain; version=0.0.4"
        )

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
        return await _serve(state, request, body, prompt, True, ChatShaper(plan, in_reasoning), forced)

    return app


def _discovery(cfg: RouterConfig, state: RouterState):
    from .discovery import K8sDiscovery

    polls: set[asyncio.Task] = set()

    def poll_now(inst):  # usable at once, not after the next tick; a slow peer does not hold up the watch
        task = asyncio.create_task(state.pool.poll(state.client, inst))
        polls.add(task)
        task.add_done_callback(polls.discard)

    return K8sDiscovery(state.pool, cfg.selector, cfg.namespace, cfg.k8s_api, on_added=poll_now)


def _add_error_handlers(app: FastAPI, max_body_bytes: int, api_key: str | None) -> None:
    install_edge(app, max_body_bytes, token=api_key, protect=lambda path: path.startswith("/v1/"))

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, exc: P.ApiError):
        return exc.response()


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
    shaper: ChatShaper | None = None,
    tool_grammar: str | None = None,
):
    """shaper: a chat choice's reasoning / content / tool calls; tool_grammar: a forced tool call's."""
    try:
        params = GenParams(
            **P.check_sampling(body, state.cfg.default_max_tokens, state.tokenizer.vocab_size),
            grammar=await response_grammar(body.response_format, tool_grammar),
        )
        if params.grammar is not None and params.ignore_eos:
            raise P.ApiError(400, "ignore_eos cannot be combined with response_format", "ignore_eos")
        state.orch.check_fits(len(prompt), params.max_tokens)
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
    pieces = _pieces(state, prompt, params, body.stop_list(), deadline, getattr(body, "echo", False))
    if not body.stream:
        return await _until_disconnect(request, _collect(state, rid, shaper, body, prompt, pieces))
    # errors before any token keep their status
    first = await _until_disconnect(request, _first_piece(pieces))
    return StreamingResponse(
        _sse(state, rid, shaper, body, len(prompt), first, pieces), media_type="text/event-stream"
    )


@dataclass
class Piece:
    """What may go to the client now: text, the token ids (and their logprobs) it came from, and the
    finish reason on the last piece. `prompt`: the echoed prompt (its ids and logprobs)."""

    text: str
    ids: list[int]
    logprobs: list = field(default_factory=list)  # contracts.Logprob | None per id, with logprobs
    reason: str | None = None
    prompt: bool = False


async def _pieces(
    state: RouterState, prompt: list[int], params: GenParams, stop: list[str], deadline: float, echo: bool
):
    """Yields Pieces; records the latency metrics and the outcome."""
    m, text = state.metrics, TextStream(state.tokenizer, stop)
    start = last = time.perf_counter()
    ids: list[int] = []
    lps: list = []
    outcome = "aborted"  # a client that leaves ends here with a CancelledError / GeneratorExit
    if echo and params.prompt_logprobs is None:
        yield Piece(state.tokenizer.decode(prompt), list(prompt), [], prompt=True)
    try:
        async with aclosing(state.orch.generate(prompt, params, deadline)) as events:
            async for ev in events:
                now = time.perf_counter()
                if isinstance(ev, PrefillReply):  # echo with logprobs: the prompt's, first
                    yield Piece(state.tokenizer.decode(prompt), list(prompt), ev.prompt_logprobs, prompt=True)
                    continue
                if isinstance(ev, str):  # the finish reason
                    outcome = "completed"
                    yield Piece(text.finish(), ids, lps, ev)
                    return
                if text.token_ids:
                    m.itl.observe(now - last)
                else:
                    m.ttft.observe(now - start)
                last, m.tokens = now, m.tokens + 1
                ids.append(ev.token)
                if ev.logprob is not None:
                    lps.append(ev.logprob)
                delta = text.add(ev.token)
                if text.stopped:  # a stop string: closing `events` aborts both halves
                    outcome = "completed"
                    yield Piece(delta, ids, lps, "stop")
                    return
                if delta:
                    yield Piece(delta, ids, lps)
                    ids, lps = [], []
    except NoInstance as e:
        outcome = "unavailable"
        raise P.ApiError(503, str(e)) from None
    except BadRequest as e:
        outcome = "client_error"
        raise P.ApiError(400, str(e)) from None
    except Overloaded as e:
        outcome = "rejected"
        raise P.ApiError(
            429, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    except DeadlineExceeded as e:
        outcome = "timeout"
        raise P.ApiError(
            504, f"{e} ({state.cfg.request_timeout_s:g} s, --request-timeout)", code="timeout"
        ) from None
    except RequestFailed as e:
        outcome = "failed"
        raise P.ApiError(502, str(e)) from None
    except P.ApiError:
        outcome = "failed"
        raise
    except Exception as e:  # a bug: the client still gets a clean error; the traceback goes to the log
        outcome = "failed"
        error_id = new_error_id()
        log.error("error %s while serving a request", error_id, exc_info=e)
        raise P.ApiError(500, f"internal error (error id {error_id})") from None
    finally:
        m.e2e.observe(time.perf_counter() - start)
        m.finished(outcome)


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


async def _first_piece(pieces):
    return await anext(pieces)


async def _collect(state, rid: str, shaper: ChatShaper | None, body, prompt: list[int], pieces) -> dict:
    chat = shaper is not None
    texts, ids, reason, lps = [], [], None, None
    fmt = LogprobFormatter(state.tokenizer, chat)
    async with aclosing(pieces):
        async for piece in pieces:
            texts.append(piece.text)
            if not piece.prompt:
                ids += piece.ids
            reason = piece.reason
            if piece.logprobs:
                lps = merge_logprobs(lps, fmt.format(piece.ids, piece.logprobs))
    text, ids_out = "".join(texts), ids if body.return_token_ids else None
    if chat:
        message = shaper.message(text)  # parsed first: it decides the finish reason
        choice = P.choice(True, False, "", shaper.finish_reason(reason), ids_out, logprobs=lps)
        choice["message"] = message
    else:
        choice = P.choice(False, False, text, reason, ids_out, logprobs=lps)
    return {
        **P.envelope(rid, state.cfg.model_name, chat, False),
        "choices": [choice],
        "usage": P.usage(len(prompt), len(ids)),
    }


async def _sse(state, rid: str, shaper: ChatShaper | None, body, prompt_len: int, first, pieces):
    chat = shaper is not None
    head = P.envelope(rid, state.cfg.model_name, chat, True)
    n, piece, fmt = 0, first, LogprobFormatter(state.tokenizer, chat)
    async with aclosing(pieces):
        try:
            while True:
                if not piece.prompt:
                    n += len(piece.ids)
                lps = fmt.format(piece.ids, piece.logprobs) if piece.logprobs else None
                ids = piece.ids if body.return_token_ids and not piece.prompt else None
                if chat:
                    delta = shaper.delta(piece.text, piece.reason is not None)  # first: it decides the reason
                    c = P.choice(True, True, "", shaper.finish_reason(piece.reason), ids, logprobs=lps)
                    c["delta"] = {"role": "assistant", "content": "", **delta} if piece is first else delta
                else:
                    c = P.choice(False, True, piece.text, piece.reason, ids, logprobs=lps)
                yield _event({**head, "choices": [c]})
                if piece.reason is not None:
                    break
                piece = await anext(pieces)
        except P.ApiError as e:  # after the first token: an error event ends the stream
            yield _event(P.error_body(e.message, e.type, e.param, e.code))
            return
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": P.usage(prompt_len, n)})
    yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def serve(cfg: RouterConfig) -> None:
    import uvicorn

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="warning")
