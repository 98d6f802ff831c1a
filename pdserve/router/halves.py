"""The two halves of one try (orchestrator.py `_try`), each reporting onto the try's event queue.

A request asks both halves for the same `SamplingParams` (request.py; on the wire
contracts.sampling_fields). `Halves.prefill` POSTs /v1/prefill and puts
("prompt", PrefillReply) when the prefill answered (its hand-off done); `Halves.decode` reads the decode's NDJSON stream of POST /v1/generate and puts
("token", TokenEvent) per token (and per finish of a choice but the last), ("finish", FinishEvent)
for the last. Either puts ("failed", TryFailed | BadRequest) instead, and never raises for an
instance's answer: every answer is untrusted and checked against the contract (pdserve/contracts.py)
and the request (choice indices, logprobs asked for, one finish per choice). A decode failure says
its `cause` when the request could continue elsewhere once tokens went out (migration.py).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from ..contracts import (
    FinishEvent,
    GenerateRequest,
    PrefillReply,
    PrefillRequest,
    TokenEvent,
    parse_event,
    sampling_fields,
)
from ..request import SamplingParams
from .metrics import Metrics
from .pool import Instance, error_message


class BadRequest(Exception):
    """An instance refused the request itself (4xx): retrying elsewhere would not help."""


class TryFailed(Exception):
    """cause: a decode failure that migrates the request once tokens went out (migration.CAUSES:
    "stream_broken" | "health" | "lost"); None: one that ends it then."""

    def __init__(
        self,
        inst: Instance,
        message: str,
        transport: bool = False,
        overloaded: bool = False,
        cause: str | None = None,
    ):
        super().__init__(f"{inst.role} {inst.url}: {message}")
        self.inst, self.transport, self.overloaded, self.cause = inst, transport, overloaded, cause


class Halves:
    def __init__(self, client: httpx.AsyncClient, metrics: Metrics, timeout_s: float):
        self.client, self.metrics, self.timeout_s = client, metrics, timeout_s

    async def prefill(
        self, inst: Instance, room: str, prompt: list[int], params: SamplingParams, events: asyncio.Queue
    ) -> None:
        body = PrefillRequest(
            token_ids=prompt,
            request_id=room,
            handoff=True,
            prompt_logprobs=params.prompt_logprobs,
            **sampling_fields(params),
        )
        start = time.perf_counter()
        try:
            r = await self.client.post(
                f"{inst.url}/v1/prefill", json=body.model_dump(), timeout=self.timeout_s
            )
        except httpx.HTTPError as e:
            events.put_nowait(("failed", TryFailed(inst, _describe(e), transport=True)))
            return
        if r.status_code != 200:
            events.put_nowait(("failed", TryFailed(inst, _error_text(r), overloaded=r.status_code == 429)))
            return
        try:
            reply = PrefillReply.model_validate_json(r.content)
        except ValueError as e:
            events.put_nowait(("failed", TryFailed(inst, f"malformed prefill answer: {_describe(e)}")))
            return
        self.metrics.observe_prefill(time.perf_counter() - start)
        if params.prompt_logprobs is not None and (
            reply.prompt_logprobs is None or len(reply.prompt_logprobs) != len(prompt)
        ):
            events.put_nowait(("failed", TryFailed(inst, "the prefill answered no prompt logprobs")))
            return
        events.put_nowait(("prompt", reply))

    async def decode(
        self,
        inst: Instance,
        bootstrap: str,
        room: str,
        prompt: list[int],
        params: SamplingParams,
        events: asyncio.Queue,
    ) -> None:
        body = GenerateRequest(
            token_ids=prompt,
            max_tokens=params.max_tokens,
            **sampling_fields(params),
            stream=True,
            request_id=room,
            bootstrap=bootstrap,
        )

        def broken(message: str, transport: bool = False) -> TryFailed:
            return TryFailed(inst, message, transport=transport, cause="stream_broken")

        try:
            async with self.client.stream(
                "POST", f"{inst.url}/v1/generate", json=body.model_dump(), timeout=self.timeout_s
            ) as r:
                if r.status_code == 429:
                    await r.aread()
                    events.put_nowait(("failed", TryFailed(inst, _error_text(r), overloaded=True)))
                    return
                if 400 <= r.status_code < 500:
                    await r.aread()
                    events.put_nowait(("failed", BadRequest(_error_text(r))))
                    return
                if r.status_code != 200:
                    await r.aread()
                    events.put_nowait(("failed", TryFailed(inst, _error_text(r))))
                    return
                done: set[int] = set()  # choices finished
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    try:
                        event = parse_event(line)
                    except ValueError as e:
                        events.put_nowait(("failed", broken(f"malformed stream line: {_describe(e)}")))
                        return
                    if isinstance(event, (TokenEvent, FinishEvent)) and event.index >= params.n:
                        events.put_nowait(("failed", broken(f"choice {event.index} of {params.n}")))
                        return
                    if isinstance(event, TokenEvent):
                        if (event.logprob is None) != (params.logprobs is None):
                            events.put_nowait(("failed", broken("a token without the logprobs asked for")))
                            return
                        events.put_nowait(("token", event))
                    elif isinstance(event, FinishEvent):
                        if event.index in done:
                            events.put_nowait(("failed", broken(f"choice {event.index} finished twice")))
                            return
                        done.add(event.index)  # the last choice's finish ends the request
                        events.put_nowait(("finish" if len(done) == params.n else "token", event))
                        if len(done) == params.n:
                            return
                    else:  # lost: the instance failed, not the request (a rank died, it stopped)
                        cause = "lost" if event.lost else None
                        events.put_nowait(("failed", TryFailed(inst, event.error[:500], cause=cause)))
                        return
            events.put_nowait(("failed", broken("stream ended without a finish")))
        except httpx.HTTPError as e:
            events.put_nowait(("failed", broken(_describe(e), transport=True)))


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error_text(r: httpx.Response) -> str:
    try:
        detail = error_message(r.json()) or r.text[:200]
    except ValueError:
        detail = r.text[:200]
    return f"HTTP {r.status_code}: {detail}"
