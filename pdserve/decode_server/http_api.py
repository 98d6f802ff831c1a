"""HTTP API of a decode instance.

GET  /live         200 while the HTTP server runs (Kubernetes liveness; /health is readiness)
GET  /health       200 {"status": "ok"} while every rank lives; 503 {"error": "rank 1 (pid ...) ..."} otherwise;
                   503 {"status": "draining"} after SIGTERM (new requests get 503, running ones finish)
GET  /capacity     total / free KV tokens, bytes per token per rank (docs/design.md invariant 6), index mode,
                   tp_size, dcp_size, moe_ep, kv_cache_dtype, page_size, running / queued requests, ranks (pid, cache bytes)
GET  /info         /capacity plus each rank's weight bytes and their split by dtype (fp8 weights and
                  their block scales, the run dtype, float32 islands); the KV tokens are total_tokens
                  and kv_tokens_from the flag that sized them (on cuda by default
                  --gpu-memory-utilization: the ranks' choice)
POST /v1/generate  {"token_ids": [...], "max_tokens": 16, "temperature", "top_p", "top_k", "seed",
                    "stop_token_ids": [], "ignore_eos": false, "min_tokens", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias": [[id, bias]], "logprobs"?,
                    "grammar"?, "stream": false, "request_id"?, "bootstrap"?}
                   -> {"request_id", "token_ids", "finish_reason", "logprobs"?}; with "stream": true,
                   newline-delimited JSON: one {"token": id, "logprob"?} line per token, then {"finish_reason", "request_id"}
                   (or {"error", "request_id", "lost"?} if it failed; "lost": true when the instance
                   failed, not the request, e.g. a rank died). Bad input is a 400 with the reason.
                   (Bodies, answers and stream events: pdserve/contracts.py.)
                   With "bootstrap" (a prefill instance's side channel, tcp://host:port from its /info)
                   the cache comes by KV hand-off: request_id is the room the prefill is asked to
                   prefill for; a failed hand-off ends the request with an error (event).
POST /v1/abort     {"request_id"} -> {"aborted": true | false (no such live request)}
POST /flush_cache  -> {"flushed_tokens"}: the prefix cache's unreferenced pages go back (on the loop thread)

A request's lifecycle is written once, in scheduler.py (the queues, from the HTTP handler to its
last event); the handlers only validate, submit to the loop thread (loop.py, which alone owns the
instance) and relay the request's events.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse

from ..contracts import (
    AbortReply,
    AbortRequest,
    DecodeCapacity,
    ErrorEvent,
    FinishEvent,
    GenerateReply,
    GenerateRequest,
    Logprob,
    RankInfo,
    TokenEvent,
    checked_params,
    event_line,
)
from ..kvcache import capacity
from ..request import Overloaded, SamplingParams
from ..serving.http_edge import add_flush_route, instance_app, refuse_if_draining, too_busy
from ..serving.instance_loop import Finished, Token, Unavailable

DISCONNECT_POLL_S = 1.0  # how often a non-streaming handler checks whether its client is still there


def create_app(cfg, instance, loop, dead_rank, drain=None) -> FastAPI:
    """cfg: DecodeServerConfig; loop: loop.DecodeLoop; dead_rank() -> message or None;
    drain: serving.drain.Drain (graceful shutdown) or None."""
    mcfg, alloc = instance.model_config, instance.allocator
    static = {  # fixed for the life of the instance
        "total_tokens": alloc.num_pages * alloc.page_size,
        "page_size": alloc.page_size,
        "bytes_per_token_per_rank": capacity.bytes_per_token_per_rank(
            mcfg, cfg.dcp_size, cfg.dcp_index, cfg.kv_cache_dtype, cfg.dtype
        ),
        "index_mode": cfg.dcp_index,
        "tp_size": cfg.tp_size,
        "dcp_size": cfg.dcp_size,
        "moe_ep": cfg.moe_ep,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "kv_tokens_from": (
            f"--gpu-memory-utilization {cfg.gpu_memory_utilization}"
            if cfg.sized_by_memory()
            else ("--kv-memory" if cfg.kv_memory is not None else "--max-kv-tokens")
        ),
        "dtype": cfg.dtype,
        "ranks": [RankInfo(rank=r.rank, pid=r.pid, cache_bytes=r.cache_bytes) for r in instance.rank_infos],
    }
    ranks = [  # /info: what each rank holds
        RankInfo(
            rank=r.rank,
            pid=r.pid,
            cache_bytes=r.cache_bytes,
            weight_bytes=r.weight_bytes,
            weight_bytes_by_dtype=r.weight_bytes_by_dtype,
        )
        for r in instance.rank_infos
    ]

    app = instance_app("pdserve decode instance", getattr(cfg, "internal_token", None), dead_rank, drain)

    @app.get("/capacity")
    def capacity_() -> DecodeCapacity:
        return DecodeCapacity(**static, **loop.stats)

    @app.get("/info")
    def info() -> DecodeCapacity:
        """/capacity with each rank's weight bytes (by dtype); kv tokens: total_tokens."""
        return DecodeCapacity(**{**static, "ranks": ranks}, **loop.stats)

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest, request: Request):
        refuse_if_draining(drain)
        params = await _sampling_params(body, mcfg.vocab_size)
        request_id = body.request_id or f"gen-{uuid.uuid4().hex}"
        aio, events = asyncio.get_running_loop(), asyncio.Queue()
        accepted = loop.submit(
            body.token_ids,
            params,
            request_id,
            lambda ev: aio.call_soon_threadsafe(events.put_nowait, ev),
            body.bootstrap,
        )
        try:
            await asyncio.wrap_future(accepted)
        except ValueError as e:  # the scheduler's verdict, e.g. more KV slots than the instance holds
            raise HTTPException(400, str(e)) from None
        except Unavailable as e:
            raise HTTPException(503, str(e)) from None
        except Overloaded as e:
            raise too_busy(str(e)) from None
        except Exception as e:
            raise HTTPException(500, f"request {request_id} failed: {type(e).__name__}: {e}") from None
        # also catches a client that left during the local prefill, or before its stream started
        watcher = asyncio.create_task(_abort_on_disconnect(request, request_id, loop))
        if body.stream:
            return StreamingResponse(
                _stream(request_id, events, loop, watcher, params.n), media_type="application/x-ndjson"
            )
        return await _collect(request_id, events, watcher)

    @app.post("/v1/abort")
    async def abort(body: AbortRequest) -> AbortReply:
        return AbortReply(aborted=await asyncio.wrap_future(loop.abort(body.request_id)))

    add_flush_route(app, loop, instance.flush_cache)

    return app


async def _sampling_params(body: GenerateRequest, vocab: int) -> SamplingParams:
    if body.n > 1 and not body.stream:
        raise HTTPException(400, "n > 1 needs stream: true (each line names its choice)")
    try:
        return await checked_params(body, vocab, body.max_tokens)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


async def _stream(request_id: str, events: asyncio.Queue, loop, watcher: asyncio.Task, n: int = 1):
    """The NDJSON lines of every choice; the stream ends after the n-th finish (or any error)."""
    ended, finished = False, set()
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, Token):
                yield event_line(
                    TokenEvent(token=ev.token, logprob=Logprob.from_wire(ev.logprobs), index=ev.index)
                )
                continue
            if isinstance(ev, Finished):
                finished.add(ev.index)
                ended = len(finished) == n
                yield event_line(FinishEvent(finish_reason=ev.reason, request_id=request_id, index=ev.index))
                if ended:
                    return
                continue
            ended = True  # the instance's failure (lost): the router may migrate the request
            yield event_line(ErrorEvent(error=ev.message, request_id=request_id, lost=ev.instance_failed))
            return
    finally:  # starlette cancels this generator when the client disconnects
        watcher.cancel()
        if not ended:
            loop.abort(request_id)  # frees the request's pages; nothing waits for the answer


async def _collect(request_id: str, events: asyncio.Queue, watcher: asyncio.Task):
    tokens: list[int] = []
    logprobs: list[Logprob] = []
    try:
        while True:
            ev = await events.get()
            if isinstance(ev, Token):
                tokens.append(ev.token)
                if ev.logprobs:
                    logprobs.append(Logprob.from_wire(ev.logprobs))
            elif isinstance(ev, Finished):  # "abort" too, when the watcher saw the client leave
                return GenerateReply(
                    request_id=request_id,
                    token_ids=tokens,
                    finish_reason=ev.reason,
                    logprobs=logprobs or None,
                )
            else:
                raise HTTPException(500, f"request {request_id} failed: {ev.message}")
    finally:
        watcher.cancel()


async def _abort_on_disconnect(request: Request, request_id: str, loop) -> None:
    """Starlette does not cancel a handler whose client left before its response started: poll, then abort."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    loop.abort(request_id)  # frees its pages; a no-op if the request already ended
