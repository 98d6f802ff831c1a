"""HTTP control API of a prefill instance.

GET  /live        200 while the HTTP server runs (Kubernetes liveness; /health is readiness)
GET  /health      200 when every rank is alive, 503 with the failed rank otherwise; 503
                  {"status": "draining"} after SIGTERM (new requests get 503, running ones finish)
GET  /info        model, ranks (pid, cache bytes, layers held), layout, storage, free / total KV tokens,
                  queued requests (also as `queue_depth`, the old name, for one release)
POST /v1/prefill  {"token_ids": [...], "temperature", "top_p", "top_k", "seed", "request_id"?,
                   "chunk_size"?, "handoff"?} -> {"request_id", "first_token", "prompt_tokens", "seconds"}
                  (bodies and answers: pdserve/contracts.py)
                  With "handoff": true the request_id is a room: the cache goes to the decode instance
                  that reserves that room on this instance's side channel (/info "bootstrap"); the
                  answer comes after the transfer. A failed hand-off is a 502 naming the reason.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, HTTPException

from ..contracts import Logprob, PrefillInfo, PrefillReply, PrefillRequest
from ..engine.http_edge import install_edge, too_busy
from ..engine.request import Overloaded
from ..engine.watchdog import add_health_route
from .scheduler import PrefillJob, PrefillScheduler


def create_app(
    instance,
    scheduler: PrefillScheduler,
    dead_rank,
    bootstrap_timeout_s: float = 30.0,
    drain=None,
    token: str | None = None,
) -> FastAPI:
    """dead_rank() -> message naming a dead rank, or None; drain: engine.drain.Drain or None;
    token: the internal token every path but /health and /live requires (None: open, tests only)."""
    app = FastAPI(title="pdserve prefill instance")
    install_edge(app, token=token)
    add_health_route(app, dead_rank, drain and (lambda: drain.draining))

    @app.get("/live")
    def live():
        return {"status": "ok"}

    @app.get("/info")
    def info() -> PrefillInfo:
        bootstrap = scheduler.bootstrap.endpoint if scheduler.bootstrap is not None else None
        queued = scheduler.queue_depth
        return PrefillInfo(**instance.info(), queued=queued, queue_depth=queued, bootstrap=bootstrap)

    @app.post("/v1/prefill")
    async def prefill(body: PrefillRequest) -> PrefillReply:
        if drain and drain.draining:
            raise HTTPException(503, drain.refusal())
        try:  # max_tokens 1: the prefill samples the first token only
            params = body.sampling_params(
                instance.model_config.vocab_size, 1, prompt_logprobs=body.prompt_logprobs
            )
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        if body.handoff and not body.request_id:
            raise HTTPException(400, "a hand-off needs the room as request_id")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        job = PrefillJob(
            list(body.token_ids),
            params,
            chunk_size=body.chunk_size,
            on_done=lambda j: loop.call_soon_threadsafe(_resolve, done, j),
            handoff=body.handoff,
            bootstrap_timeout_s=bootstrap_timeout_s,
        )
        if body.request_id:
            job.request_id = body.request_id
        start = time.perf_counter()
        try:
            scheduler.submit(job)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        except Overloaded as e:
            raise too_busy(str(e)) from None
        try:
            await done
        except asyncio.CancelledError:  # the client went away
            scheduler.abort(job.request_id)
            raise
        if job.error:
            raise HTTPException(
                502 if body.handoff else 500, f"prefill of {job.request_id} failed: {job.error}"
            )
        return PrefillReply(
            request_id=job.request_id,
            first_token=job.first_token,
            prompt_tokens=len(job.token_ids),
            seconds=time.perf_counter() - start,
            prompt_logprobs=_logprobs(job.prompt_logprobs),
        )

    return app


def _logprobs(entries: list | None) -> list[Logprob | None] | None:
    if entries is None:
        return None
    return [None if e is None else Logprob.from_wire(e.wire()) for e in entries]


def _resolve(fut: asyncio.Future, job: PrefillJob) -> None:
    if not fut.done():
        fut.set_result(job)
