"""One request through a prefill and a decode instance (docs/design.md section 4), with retries.

A try picks a pair, makes a room id, and sends to both halves at once: the decode's
POST /v1/generate (NDJSON stream, `bootstrap` = the prefill's side channel) and the prefill's
POST /v1/prefill (`handoff`), bodies and answers built and parsed with pdserve/contracts.py. Both feed one event queue, so whichever half fails first ends the
try at once: the decode half is aborted (POST /v1/abort, and its stream closed) and the prefill's
request is dropped. A try that failed before any token went out is repeated on another pair
(`max_attempts`, exponential backoff). After the first token, a failure of the decode instance
(its stream broke, it answered that the request was lost, or it failed its health check while
silent for HEALTH_CHECK_S) migrates the request (migration.py: every unfinished choice continues
on another pair from the tokens it sent, at most `max_migrations` times per request); a failure
of the request itself (the decode's error event for it, the deadline) ends it with an error, and
a prefill that fails once the decode streams is ignored (the decode holds the cache).
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
from contextlib import aclosing

import httpx

from ..contracts import AbortRequest, FinishEvent, PrefillReply, TokenEvent
from ..kvcache.kv_fit import Need
from ..request import (
    Overloaded,  # the router's queue is full, or every instance tried was
    SamplingParams,
)
from .halves import BadRequest, Halves, TryFailed
from .metrics import Metrics
from .migration import Progress, merge
from .pool import Instance, NoInstance, Pool, Saturated, TooLong

__all__ = ["BadRequest", "DeadlineExceeded", "Orchestrator", "Overloaded", "RequestFailed"]

PREFILL_ANSWER_GRACE_S = 1.0  # how long the last finish waits for a late prefill answer (usage)
HEALTH_CHECK_S = 0.5  # a try whose decode is silent this long fails if its instance failed a health check


class RequestFailed(Exception):
    """The request could not be served (502 before the first token; an error event after it)."""


class DeadlineExceeded(RequestFailed):
    """The request ran past its deadline (504 before the first token; an error event after it)."""


class Migrate(Exception):
    """A try failed after it sent tokens, in a way another pair can continue (migration.py)."""

    def __init__(self, failure: TryFailed):
        super().__init__(str(failure))
        self.failure = failure


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
        max_migrations: int = 3,
        eos_ids: tuple[int, ...] = (),
        migration_wait_s: float = 30.0,
    ):
        """migration_wait_s: how long a continuation waits for a usable pair (a restarted instance)."""
        self.pool, self.client, self.metrics = pool, client, metrics
        self.max_attempts, self.backoff_s, self.timeout_s = max_attempts, backoff_s, timeout_s
        self.max_migrations, self.eos_ids, self.migration_wait_s = max_migrations, eos_ids, migration_wait_s
        self.halves = Halves(client, metrics, timeout_s)
        self.max_queue, self.queued = max_queue, 0
        self._background: set[asyncio.Task] = set()

    def check_fits(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        """Raises pool.TooLong / NoInstance before anything is streamed (400 / 503)."""
        self.pool.candidates("decode", Need(prompt_len, max_tokens, n), admit=False)
        self.pool.candidates("prefill", prompt_len, admit=False)

    async def generate(self, prompt: list[int], params: SamplingParams, deadline: float):
        """Yields the prefill's PrefillReply first when params.prompt_logprobs is set (else before
        the last FinishEvent, when it came: usage's cached tokens), one TokenEvent per token (id,
        logprob, choice index) and one FinishEvent per choice (reason "stop" | "length" | "abort");
        the n-th FinishEvent is the last event.
        `deadline` (time.monotonic()) bounds the whole request, every try and wait included."""
        progress, budget = Progress(prompt, params, self.eos_ids), [self.max_migrations]
        choices = list(range(params.n))
        async with aclosing(self._group(progress, prompt, params, choices, deadline, budget, True)) as events:
            async for event in events:
                yield event

    async def _group(
        self,
        progress: Progress,
        prompt: list[int],
        params: SamplingParams,
        choices: list[int],
        deadline: float,
        budget: list[int],
        first: bool,
        avoid: frozenset[str] = frozenset(),
    ):
        """Choices `choices` of the request, run as one request (prompt, params); yields their events
        under the choices' own indices. A failure after tokens went out migrates each unfinished
        choice (migration.py), concurrently, each in a group of its own; `budget`: the migrations
        left to the whole request; `first`: the original request (a continuation's prefill answer
        is not the client's: usage's cached tokens and the echo come from the first)."""
        try:
            async with aclosing(self._attempts(prompt, params, deadline, set(avoid), first)) as events:
                async for event in events:
                    if isinstance(event, (TokenEvent, FinishEvent)):
                        event = event.model_copy(update={"index": choices[event.index]})
                        progress.record(event)
                    elif not first:
                        continue
                    yield event
            return
        except Migrate as e:
            failure = e.failure
        if budget[0] <= 0:
            after = f" (after {self.max_migrations} migrations)" if self.max_migrations else ""
            raise RequestFailed(f"{failure}{after}")
        budget[0] -= 1
        self.metrics.migrated(failure.cause)
        runs = []
        for i in progress.unfinished(choices):
            if (reason := progress.ended(i)) is not None:  # its finish was lost on the way
                event = FinishEvent(finish_reason=reason, request_id="migrated", index=i)
                progress.record(event)
                yield event
                continue
            p, gp = progress.continuation(i)
            avoid = frozenset({failure.inst.url})
            runs.append(self._group(progress, p, gp, [i], deadline, budget, False, avoid))
        if runs:
            async with aclosing(merge(runs)) as events:
                async for event in events:
                    yield event

    async def _attempts(
        self, prompt: list[int], params: SamplingParams, deadline: float, avoid: set[str], answer: bool
    ):
        """One request's tries on different pairs while none sent a token; Migrate or RequestFailed
        when a try fails after it did. answer: wait for a late prefill answer (usage) at the end."""
        last: TryFailed | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), _left(deadline)))
            try:
                prefill, decode = await self._pick(
                    prompt, params, avoid, deadline, 0 if answer else self.migration_wait_s
                )
            except NoInstance:
                if last is None:
                    raise
                break
            sent = False
            try:
                async for event in self._try(prefill, decode, prompt, params, deadline, answer):
                    sent = sent or isinstance(event, TokenEvent)
                    yield event
                return
            except TryFailed as e:
                self._after_failure(e)
                avoid.add(e.inst.url)
                last = e
                if sent and e.cause is not None and e.inst.role == "decode":
                    raise Migrate(e) from None
                if sent:
                    raise RequestFailed(str(e)) from None
                self.metrics.retry(e.inst.role)
        if last is not None and last.overloaded:
            self.metrics.rejected("instances_full")
            raise Overloaded(f"every instance tried is full ({last})")
        raise RequestFailed(f"failed after {attempt + 1} tries: {last}")

    async def _pick(
        self,
        prompt: list[int],
        params: SamplingParams,
        avoid: set[str],
        deadline: float,
        patience_s: float = 0,
    ):
        """A (prefill, decode) pair with room, waiting for one while at most max_queue others wait.
        With `patience_s` (a continuation: its stream must go on) it also waits that long for a
        usable instance when there is none (NoInstance after that, also when only instances too
        small for it are up: check_fits passed before the request began)."""
        queued, prompt_len = False, len(prompt)
        patient = min(deadline, time.monotonic() + patience_s)
        try:
            while True:
                try:
                    ns = params.cache_namespace
                    need = Need(prompt_len, params.max_tokens, params.n)
                    decode = self.pool.pick("decode", need, avoid, prompt, ns)
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
                except (NoInstance, TooLong) as e:  # TooLong: the instances it fitted are down
                    if time.monotonic() >= patient:
                        raise e if isinstance(e, NoInstance) else NoInstance(str(e)) from None
                    await asyncio.sleep(min(HEALTH_CHECK_S, patient - time.monotonic()))
        finally:
            if queued:
                self.queued -= 1

    async def _try(
        self,
        prefill: Instance,
        decode: Instance,
        prompt: list[int],
        params: SamplingParams,
        deadline: float,
        answer: bool = True,
    ):
        room = f"room-{uuid.uuid4().hex}"
        events: asyncio.Queue = asyncio.Queue()
        prefill.in_flight += 1
        decode.in_flight += 1
        p_task = self._guarded(prefill, events, self.halves.prefill(prefill, room, prompt, params, events))
        d_task = self._guarded(
            decode, events, self.halves.decode(decode, prefill.bootstrap, room, prompt, params, events)
        )
        finished, answered, held = False, not answer, [] if params.prompt_logprobs is not None else None
        streaming = False  # a token came: the decode holds the cache, the prefill's fate no longer matters
        try:
            while True:
                try:
                    kind, value = await next_event(events, min(_left(deadline), HEALTH_CHECK_S))
                except TimeoutError:
                    if _left(deadline) <= 0:
                        raise DeadlineExceeded("the request ran past its deadline") from None
                    if decode.healthy or decode.stopping:  # a draining instance finishes what runs
                        continue
                    raise TryFailed(
                        decode, f"failed its health check ({decode.error})", cause="health"
                    ) from None
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
                    streaming = True
                    yield value
                elif kind == "finish":
                    finished = True
                    prefill.served, decode.served = prefill.served + 1, decode.served + 1
                    if not answered and (reply := await _late_answer(events, deadline)) is not None:
                        yield reply  # usage's cached tokens; the consumer stops at the last finish
                    yield value
                    return
                elif kind == "failed":
                    if streaming and isinstance(value, TryFailed) and value.inst is prefill:
                        continue
                    raise value
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1
            self.pool.released()
            if not finished:
                d_task.cancel()  # closes the stream: the decode aborts on disconnect too
                self._detach(self._abort(decode, room))
            p_task.cancel()  # after a finish the prefill already answered or is about to: nothing is lost

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
