"""One request through a prefill and a decode instance (docs/design.md section 4), with retries.

A try picks a pair, makes a room id, and sends to both halves at once: the decode's
POST /v1/generate (NDJSON stream, `bootstrap` = the prefill's side channel) and the prefill's
POST /v1/prefill (`handoff`), bodies and answers built and parsed with pdserve/contracts.py. Both feed one event queue, so whichever half fails first ends the
try at once: the decode half is aborted (POST /v1/abort, and its stream closed) and the prefill's
request is dropped. A try that failed before any token went out is repeated on another pair
(`max_attempts`, exponential backoff); after the first token an error ends the request.
Cleanup of a try never awaits inside a cancelled task: the aborts run as detached tasks.

Nothing dies unobserved: each half catches every exception and reports it as the try's failure,
and every wait is bounded by the request's deadline (`DeadlineExceeded`, 504 or an error event).
Admission: a pair is chosen only among instances with fewer than the pool's max_in_flight of this
router's requests; when all are full a request waits for room, up to `max_queue` waiting requests
(`Overloaded`, 429 beyond). An instance that answers 429 is skipped like a failed try; when every
try met a full instance the request gets 429 too.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import httpx

from ..contracts import (
    AbortRequest,
    FinishEvent,
    GenerateRequest,
    PrefillReply,
    PrefillRequest,
    TokenEvent,
    parse_event,
)
from ..engine.request import Overloaded  # the router's queue is full, or every instance tried was
from .metrics import Metrics
from .pool import Instance, NoInstance, Pool, Saturated, error_message

PREFILL_ANSWER_GRACE_S = 1.0  # how long the last finish waits for a late prefill answer (usage)


@dataclass(frozen=True)
class GenParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # the sampled tokens' and the top k
    grammar: str | None = None  # llguidance's (engine/constraint.py grammar_for)
    prompt_logprobs: int | None = None  # echo: the prefill's reply comes first in generate()
    n: int = 1  # choices from one prefill (the decode copies the prompt's cache for each)
    cache_namespace: str = ""  # the prefix caches' namespace (tenants.py); "": the shared one

    def sampling(self) -> dict:
        """The fields both halves sample with (contracts._Sampling), and the cache namespace."""
        names = (
            "temperature top_p top_k seed ignore_eos stop_token_ids min_tokens presence_penalty "
            "frequency_penalty repetition_penalty logit_bias logprobs grammar n cache_namespace"
        ).split()
        return {n: getattr(self, n) for n in names}


class BadRequest(Exception):
    """An instance refused the request itself (4xx): retrying elsewhere would not help."""


class RequestFailed(Exception):
    """The request could not be served (502 before the first token; an error event after it)."""


class DeadlineExceeded(RequestFailed):
    """The request ran past its deadline (504 before the first token; an error event after it)."""


class TryFailed(Exception):
    def __init__(self, inst: Instance, message: str, transport: bool = False, overloaded: bool = False):
        super().__init__(f"{inst.role} {inst.url}: {message}")
        self.inst, self.transport, self.overloaded = inst, transport, overloaded


class Orchestrator:
    def __init__(
        self,
        pool: Pool,
        client: httpx.AsyncClient,
        metrics: Metrics,
        max_attempts: int,
        backoff_s: float,
        timeout_s: float,
        max_queue: int = 1 << 30,
    ):
        self.pool, self.client, self.metrics = pool, client, metrics
        self.max_attempts, self.backoff_s, self.timeout_s = max_attempts, backoff_s, timeout_s
        self.max_queue, self.queued = max_queue, 0
        self._background: set[asyncio.Task] = set()

    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Raises pool.TooLong / NoInstance before anything is streamed (400 / 503)."""
        self.pool.candidates("decode", n * (prompt_len + max_tokens), admit=False)
        self.pool.candidates("prefill", prompt_len, admit=False)

    async def generate(self, prompt: list[int], params: GenParams, deadline: float):
        """Yields the prefill's PrefillReply first when params.prompt_logprobs is set (else before
        the last FinishEvent, when it came: usage's cached tokens), one TokenEvent per token (id,
        logprob, choice index) and one FinishEvent per choice (reason "stop" | "length" | "abort");
        the n-th FinishEvent is the last event.
        `deadline` (time.monotonic()) bounds the whole request, every try and wait included."""
        avoid: set[str] = set()
        last: TryFailed | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), _left(deadline)))
            try:
                prefill, decode = await self._pick(prompt, params, avoid, deadline)
            except NoInstance:
                if last is None:
                    raise
                break
            sent = False
            try:
                async for event in self._try(prefill, decode, prompt, params, deadline):
                    sent = sent or isinstance(event, TokenEvent)
                    yield event
                return
            except TryFailed as e:
                self.metrics.retry(e.inst.role)
                self._after_failure(e)
                avoid.add(e.inst.url)
                last = e
                if sent:
                    raise RequestFailed(str(e)) from None
        if last is not None and last.overloaded:
            self.metrics.rejected("instances_full")
            raise Overloaded(f"every instance tried is full ({last})")
        raise RequestFailed(f"failed after {attempt + 1} tries: {last}")

    async def _pick(self, prompt: list[int], params: GenParams, avoid: set[str], deadline: float):
        """A (prefill, decode) pair with room, waiting for one while at most max_queue others wait."""
        queued, prompt_len = False, len(prompt)
        try:
            while True:
                try:
                    ns = params.cache_namespace
                    decode = self.pool.pick(
                        "decode", params.n * (prompt_len + params.max_tokens), avoid, prompt, ns
                    )
                    return self.pool.pick("prefill", prompt_len, avoid, prompt, ns), decode
                except Saturated:
                    if not queued:
                        if self.queued >= self.max_queue:
                            self.metrics.rejected("router_queue_full")
                            raise Overloaded(
                                f"the router's queue is full ({self.max_queue} requests wait for an instance)"
                            ) from None
                        queued, self.queued = True, self.queued + 1
                    if _left(deadline) <= 0:
                        raise DeadlineExceeded("no instance had room before the request's deadline") from None
                    await self.pool.wait_for_room(min(1.0, _left(deadline)))
        finally:
            if queued:
                self.queued -= 1

    async def _try(
        self, prefill: Instance, decode: Instance, prompt: list[int], params: GenParams, deadline: float
    ):
        room = f"room-{uuid.uuid4().hex}"
        events: asyncio.Queue = asyncio.Queue()
        prefill.in_flight += 1
        decode.in_flight += 1
        p_task = self._guarded(prefill, events, self._prefill(prefill, room, prompt, params, events))
        d_task = self._guarded(
            decode, events, self._decode(decode, prefill.bootstrap, room, prompt, params, events)
        )
        finished, answered, held = False, False, [] if params.prompt_logprobs is not None else None
        try:
            while True:
                try:
                    kind, value = await next_event(events, _left(deadline))
                except TimeoutError:
                    raise DeadlineExceeded("the request ran past its deadline") from None
                if held is not None and kind in ("token", "finish"):  # the prompt's logprobs go first
                    held.append((kind, value))
                    continue
                if kind == "prompt":
                    answered = True
                    yield value
                    pending, held = held or [], None
                    for kind, value in pending:
                        if kind == "finish":  # before the yield: the consumer may stop there
                            finished = True
                            prefill.served, decode.served = prefill.served + 1, decode.served + 1
                        yield value
                        if finished:
                            return
                elif kind == "token":
                    yield value
                elif kind == "finish":
                    finished = True
                    prefill.served, decode.served = prefill.served + 1, decode.served + 1
                    if not answered and (reply := await _late_answer(events, deadline)) is not None:
                        yield reply  # usage's cached tokens; the consumer stops at the last finish
                    yield value
                    return
                elif kind == "failed":
                    raise value
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1
            self.pool.released()
            if not finished:
                d_task.cancel()  # closes the stream: the decode aborts on disconnect too
                self._detach(self._abort(decode, room))
            p_task.cancel()  # after a finish the prefill already answered or is about to: nothing is lost

    async def _prefill(
        self, inst: Instance, room: str, prompt: list[int], params: GenParams, events: asyncio.Queue
    ) -> None:
        body = PrefillRequest(
            token_ids=prompt,
            request_id=room,
            handoff=True,
            prompt_logprobs=params.prompt_logprobs,
            **params.sampling(),
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

    async def _decode(
        self,
        inst: Instance,
        bootstrap: str,
        room: str,
        prompt: list[int],
        params: GenParams,
        events: asyncio.Queue,
    ) -> None:
        body = GenerateRequest(
            token_ids=prompt,
            max_tokens=params.max_tokens,
            **params.sampling(),
            stream=True,
            request_id=room,
            bootstrap=bootstrap,
        )
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
                        events.put_nowait(
                            ("failed", TryFailed(inst, f"malformed stream line: {_describe(e)}"))
                        )
                        return
                    if isinstance(event, (TokenEvent, FinishEvent)) and event.index >= params.n:
                        events.put_nowait(("failed", TryFailed(inst, f"choice {event.index} of {params.n}")))
                        return
                    if isinstance(event, TokenEvent):
                        if (event.logprob is None) != (params.logprobs is None):
                            events.put_nowait(
                                ("failed", TryFailed(inst, "a token without the logprobs asked for"))
                            )
                            return
                        events.put_nowait(("token", event))
                    elif isinstance(event, FinishEvent):
                        if event.index in done:
                            events.put_nowait(
                                ("failed", TryFailed(inst, f"choice {event.index} finished twice"))
                            )
                            return
                        done.add(event.index)  # the last choice's finish ends the request
                        events.put_nowait(("finish" if len(done) == params.n else "token", event))
                        if len(done) == params.n:
                            return
                    else:
                        events.put_nowait(("failed", TryFailed(inst, event.error)))
                        return
            events.put_nowait(("failed", TryFailed(inst, "stream ended without a finish")))
        except httpx.HTTPError as e:
            events.put_nowait(("failed", TryFailed(inst, _describe(e), transport=True)))

    def _guarded(self, inst: Instance, events: asyncio.Queue, coro) -> asyncio.Task:
        """Runs one half; any exception it lets out (a bug, a malformed answer) fails the try."""

        async def run():
            try:
                await coro
            except Exception as e:
                events.put_nowait(("failed", TryFailed(inst, f"unexpected {type(e).__name__}: {e}")))

        return asyncio.create_task(run())

    async def _abort(self, inst: Instance, room: str) -> None:
        try:
            await self.client.post(
                f"{inst.url}/v1/abort", json=AbortRequest(request_id=room).model_dump(), timeout=5
            )
        except httpx.HTTPError:
            pass  # an unreachable instance holds nothing we could free

    def _after_failure(self, e: TryFailed) -> None:
        if e.transport:
            self.pool.suspect(e.inst, str(e))
        self._detach(self.pool.poll(self.client, e.inst))  # re-check at once rather than at the next tick

    def _detach(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error_text(r: httpx.Response) -> str:
    try:
        detail = error_message(r.json()) or r.text[:200]
    except ValueError:
        detail = r.text[:200]
    return f"HTTP {r.status_code}: {detail}"


async def next_event(events: asyncio.Queue, timeout_s: float):
    """The next item of `events`; TimeoutError after timeout_s. Not asyncio.wait_for: on Python 3.11
    it returns an item that arrives as the waiting task is cancelled and drops the cancellation
    (CPython gh-86296), so a client that left while tokens streamed in was never aborted and its
    request decoded to the end (tests/router/test_cancellation.py)."""
    async with asyncio.timeout(timeout_s):
        return await events.get()


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


async def _late_answer(events: asyncio.Queue, deadline: float) -> PrefillReply | None:
    """The prefill's answer if it comes within PREFILL_ANSWER_GRACE_S of the decode's last token
    (it normally comes first: the prefill answers once its hand-off is done); else None."""
    end = min(time.monotonic() + PREFILL_ANSWER_GRACE_S, deadline)
    while (left := end - time.monotonic()) > 0:
        try:
            kind, value = await next_event(events, left)
        except TimeoutError:
            return None
        if kind == "prompt":
            return value
    return None
