"""Streams that survive a dead decode instance: the bookkeeping of a migrated request.

When the decode instance of a running request fails after tokens went to the client (its stream
breaks, its health check fails while it is silent, or it answers that the request was `lost`:
contracts.ErrorEvent), the orchestrator (orchestrator.py `_group`) runs every unfinished choice
again on another (prefill, decode) pair, as a request of its own whose prompt is the original
prompt followed by every token the choice already sent, and goes on with the same event stream:
the client sees nothing, and `usage` counts each token once (the router's own count of what it
streamed; prompt_tokens stays the original prompt's).

The continuation of choice i after k sent tokens is exactly the request (`Progress.continuation`)

    token_ids = prompt + those k tokens, generated = those k ids (a count on the wire; the
    penalties and the grammar count them as output: contracts._Sampling), n = 1, max_tokens - k, max(0, min_tokens - k),
    seed = continued_seed(seed + i, k), no prompt logprobs,

so with greedy sampling the whole output equals an unbroken run's, token for token (the same
function of the same tokens), and with a seed it is reproducible: the continuation equals that
request sent on its own. It cannot equal the unbroken run's draws: those continue a generator
stream that lives on the dead instance's sampling rank (engine/batch_sampler.py), and replaying k
draws of a vocabulary each is not worth it. A choice that sent nothing restarts as it would have
run (continued_seed(s, 0) = s). A choice whose last sent token ended it (a stop token, EOS, its
max_tokens) whose finish was lost on the way gets that finish here, without a continuation.
Stop strings need nothing: the router's text streams (respond.py) live across the migration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from ..contracts import FinishEvent, TokenEvent
from ..request import SEED_LIMIT

CAUSES = ("stream_broken", "health", "lost")  # pdserve_router_migrations_total's label values
_pumps: set[asyncio.Task] = set()  # merge()'s tasks while they run


def continued_seed(seed: int | None, sent: int) -> int | None:
    """The seed of a choice's continuation after `sent` tokens (`seed`: the choice's own, seed + i)."""
    if seed is None or sent == 0:
        return seed
    digest = hashlib.sha256(f"pdserve-migration:{seed}:{sent}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEED_LIMIT


class Progress:
    """What each choice of one request has sent to the client, and what a continuation sends."""

    def __init__(self, prompt: list[int], params, eos_ids: Sequence[int] = ()):
        """params: request.SamplingParams; eos_ids: the model's (a sent EOS ended its choice unless
        ignore_eos)."""
        self.prompt, self.params, self.eos_ids = list(prompt), params, frozenset(eos_ids)
        self.tokens: list[list[int]] = [[] for _ in range(params.n)]
        self.done = [False] * params.n

    def record(self, event) -> None:
        """An event that went to the client (a TokenEvent or FinishEvent, its index the choice's)."""
        if isinstance(event, TokenEvent):
            self.tokens[event.index].append(event.token)
        elif isinstance(event, FinishEvent):
            self.done[event.index] = True

    def unfinished(self, choices: Sequence[int]) -> list[int]:
        return [i for i in choices if not self.done[i]]

    def ended(self, i: int) -> str | None:
        """The finish reason choice i's last sent token gave it ("stop" | "length"), or None."""
        sent, p = self.tokens[i], self.params
        if sent and (sent[-1] in p.stop_token_ids or (sent[-1] in self.eos_ids and not p.ignore_eos)):
            return "stop"
        return "length" if len(sent) >= p.max_tokens else None

    def continuation(self, i: int):
        """(prompt, SamplingParams) of choice i's continuation (the module's docstring)."""
        sent, p = self.tokens[i], self.params
        k = len(sent)
        if k >= p.max_tokens:
            raise ValueError(f"choice {i} already sent its {p.max_tokens} tokens")
        seed = None if p.seed is None else (p.seed + i) % SEED_LIMIT
        params = dataclasses.replace(
            p,
            max_tokens=p.max_tokens - k,
            min_tokens=max(0, p.min_tokens - k),
            seed=continued_seed(seed, k),
            n=1,
            prompt_logprobs=None,
            generated=tuple(sent),
        )
        return self.prompt + sent, params


async def merge(streams: list) -> AsyncIterator:
    """The events of several async generators as they come; the first exception ends them all
    (each is closed: a try's cleanup aborts its halves) and propagates."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for event in stream:
                yield event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    queue.put_nowait(("event", event))
        except Exception as e:
            queue.put_nowait(("error", e))
            return
        queue.put_nowait(("end", None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    for task in tasks:  # the loop keeps only weak references to tasks
        _pumps.add(task)
        task.add_done_callback(_pumps.discard)
    try:
        left = len(tasks)
        while left:
            kind, value = await queue.get()
            if kind == "event":
                yield value
            elif kind == "end":
                left -= 1
            else:
                raise value
    finally:
        for task in tasks:  # never awaited here: this may run inside a cancelled task
            task.cancel()
