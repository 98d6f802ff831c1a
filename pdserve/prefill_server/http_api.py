"""HTTP control API of a prefill instance.

GET  /live        200 while the HTTP server runs (Kubernetes liveness; /health is readiness)
GET  /health      200 when every rank is alive, 503 with the failed rank otherwise; 503
                  {"status": "draining"} after SIGTERM (new requests get 503, running ones finish)
GET  /info        model, ranks (pid, cache bytes, layers held), layout, storage, free / total KV tokens,
                  queued requests (also as `queue_depth`, the old name, for one release)
POST /flush_cache -> {"flushed_tokens"}: the prefix cache's unreferenced pages go back to the free pool
POST /v1/prefill  {"token_ids": [...], "temperature", "top_p", "top_k", "seed", "request_id"?,
                   "chunk_size"?, "handoff"?} -> {"request_id", "first_token", "prompt_tokens", "seconds"}
                  (bodies and answers: pdserve/contracts.py)
                  With "handoff": true the request_id is a room: the cache goes to the decode instance
                  that reserves that room on this instance's side channel (/info "bootstrap"); the
                  answer comes after the transfer. A failed hand-off is a 502 naming the reason.

A request's lifecycle is written once, in scheduler.py (from the HTTP handler to its last event);
the handlers only validate, submit to the loop thread (loop.py) and relay the request's events.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, HTTPException

from ..contracts import Logprob, PrefillInfo, PrefillReply, PrefillRequest, checked_params
from ..request import Overloaded
from ..serving.http_edge import add_flush_route, instance_app, refuse_if_draining, too_busy
from ..serving.instance_loop import Failed, Token, Unavailable
from .loop import PrefillLoop
from .scheduler import PrefillJob


def create_app(
    instance,
    prefill_loop: PrefillLoop,
    dead_rank,
    bootstrap_timeout_s: float = 30.0,
    drain=None,
    token: str | None = None,
) -> FastAPI:
    """prefill_loop: the loop thread (handlers never touch the scheduler's state but to read it);
    dead_rank() -> message naming a dead rank, or None; drain: serving.drain.Drain or None;
    token: the internal token every path but /health and /live requires (None: open, tests only)."""
    app = instance_app("pdserve prefill instance", token, dead_rank, drain)

    @app.get("/info")
    def info() -> PrefillInfo:
        bootstrap = prefill_loop.bootstrap.endpoint if prefill_loop.bootstrap is not None else None
        queued = prefill_loop.scheduler.queue_depth
        return PrefillInfo(**instance.info(), queued=queued, queue_depth=queued, bootstrap=bootstrap)

    add_flush_route(app, prefill_loop, instance.flush_cache)

    @app.post("/v1/prefill")
    async def prefill(body: PrefillRequest) -> PrefillReply:
        refuse_if_draining(drain)
        try:  # max_tokens 1: the prefill samples the first token only
            params = await checked_params(body, instance.model_config.vocab_size, 1)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        if body.handoff and not body.request_id:
            raise HTTPException(400, "a hand-off needs the room as request_id")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job = PrefillJob(
            list(body.token_ids),
            params,
            chunk_size=body.chunk_size,
            handoff=body.handoff,
            bootstrap_timeout_s=bootstrap_timeout_s,
        )
        if body.request_id:
            job.request_id = body.request_id
        start = time.perf_counter()
        accepted = prefill_loop.submit(job, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        try:
            await asyncio.wrap_future(accepted)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        except Unavailable as e:
            raise HTTPException(503, str(e)) from None
        except Overloaded as e:
            raise too_busy(str(e)) from None
        first_token = None
        try:
            ev = await events.get()
            while isinstance(ev, Token):
                first_token = ev.token
                ev = await events.get()
        except asyncio.CancelledError:  # the client went away
            prefill_loop.abort(job.request_id)
            raise
        if isinstance(ev, Failed):
            raise HTTPException(
                502 if body.handoff else 500, f"prefill of {job.request_id} failed: {ev.message}"
            )
        return PrefillReply(
            request_id=job.request_id,
            first_token=first_token,
            prompt_tokens=len(job.token_ids),
            seconds=time.perf_counter() - start,
            prompt_logprobs=_logprobs(job.prompt_logprobs),
            cached_tokens=job.cached_tokens,
        )

    return app


def _logprobs(entries: list | None) -> list[Logprob | None] | None:
    if entries is None:
        return None
    return [None if e is None else Logprob.from_wire(e.wire()) for e in entries]
