"""A request's answer from the orchestrator's events: text pieces per choice, then one JSON body or
an SSE stream (OpenAI's completion and chat shapes).

`pieces` turns TokenEvents into text with incremental detokenization and stop strings (text.py),
one TextStream per choice (n > 1), and records the latency metrics and the outcome; a choice cut by
a stop string ends there (its later tokens are dropped) and the request ends when every choice has.
`collect` builds the non-streamed body (choices in index order, usage summed over them); `sse` the
stream (each chunk one choice's piece; a chat choice's first chunk carries the role). Chat choices
go through a ChatShaper each (reasoning, content, tool calls: chat.py); logprobs through a
LogprobFormatter each (logprobs.py).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from ..contracts import FinishEvent, PrefillReply
from ..request import SamplingParams
from ..serving.http_edge import RETRY_AFTER_S, new_error_id
from . import protocol as P
from .logprobs import LogprobFormatter
from .logprobs import merge as merge_logprobs
from .orchestrator import BadRequest, DeadlineExceeded, Overloaded, RequestFailed
from .pool import NoInstance
from .redact import public, redact
from .text import TextStream

log = logging.getLogger("pdserve.router")


@dataclass
class Piece:
    """What may go to the client now for choice `index`: text, the token ids (and their logprobs)
    it came from, and the finish reason on its last piece. `prompt`: the echoed prompt."""

    text: str
    ids: list[int]
    logprobs: list = field(default_factory=list)  # contracts.Logprob | None per id, with logprobs
    reason: str | None = None
    prompt: bool = False
    index: int = 0


@dataclass
class Counts:
    """What usage reports beyond the token counts, filled in by `pieces` as the answer comes."""

    cached_tokens: int | None = None  # prompt tokens the prefill's prefix cache served


@dataclass
class _Choice:
    text: TextStream
    ids: list[int] = field(default_factory=list)  # not yet released with a piece
    lps: list = field(default_factory=list)
    done: bool = False


async def pieces(
    state,
    prompt: list[int],
    params: SamplingParams,
    stop: list[str],
    deadline: float,
    echo: bool,
    counts: Counts,
):
    """Yields Pieces; records the latency metrics, the outcome and `counts`."""
    m = state.metrics
    choices = [_Choice(TextStream(state.tokenizer, stop)) for _ in range(params.n)]
    start = last = time.perf_counter()
    outcome, seen = "aborted", False  # a client that leaves ends here with a CancelledError / GeneratorExit
    if echo and params.prompt_logprobs is None:
        for i in range(params.n):
            yield Piece(state.tokenizer.decode(prompt), list(prompt), [], prompt=True, index=i)
    try:
        async with aclosing(state.orch.generate(prompt, params, deadline)) as events:
            async for ev in events:
                if isinstance(ev, PrefillReply):
                    counts.cached_tokens = ev.cached_tokens if state.cfg.report_cached_tokens else 0
                    for i in range(params.n if params.prompt_logprobs is not None else 0):  # echo
                        text = state.tokenizer.decode(prompt)
                        yield Piece(text, list(prompt), ev.prompt_logprobs, prompt=True, index=i)
                    continue
                c = choices[ev.index]
                if isinstance(ev, FinishEvent):
                    if not c.done:
                        c.done = True
                        yield Piece(c.text.finish(), c.ids, c.lps, ev.finish_reason, index=ev.index)
                elif not c.done:
                    now = time.perf_counter()
                    (m.itl if seen else m.ttft).observe(now - (last if seen else start))
                    last, seen = now, True
                    m.token()
                    c.ids.append(ev.token)
                    if ev.logprob is not None:
                        c.lps.append(ev.logprob)
                    delta = c.text.add(ev.token)
                    if c.text.stopped:  # a stop string ends this choice
                        c.done = True
                        yield Piece(delta, c.ids, c.lps, "stop", index=ev.index)
                    elif delta:
                        yield Piece(delta, c.ids, c.lps, index=ev.index)
                        c.ids, c.lps = [], []
                if all(ch.done for ch in choices):  # closing `events` aborts what still runs
                    outcome = "completed"
                    return
    except NoInstance as e:
        outcome = "unavailable"
        raise P.ApiError(503, str(e)) from None
    except BadRequest as e:
        outcome = "client_error"
        raise P.ApiError(400, redact(str(e))) from None
    except Overloaded as e:
        outcome = "rejected"
        raise P.ApiError(
            429,
            public(e, "every instance tried was full"),
            code="overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from None
    except DeadlineExceeded as e:
        outcome = "timeout"
        raise P.ApiError(
            504, f"{e} ({state.cfg.request_timeout_s:g} s, --request-timeout)", code="timeout"
        ) from None
    except RequestFailed as e:
        outcome = "failed"
        raise P.ApiError(502, public(e, "request failed")) from None
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


async def first_piece(stream):
    return await anext(stream)


async def collect(
    state, rid: str, make_shaper, body, prompt: list[int], stream, n: int, counts: Counts
) -> dict:
    """make_shaper: () -> ChatShaper for a chat request, None for a completion. n choices were
    generated; with best_of > body.n the body.n whose sampled tokens have the largest summed
    logprob are returned (usage counts every generated token, as OpenAI bills best_of)."""
    chat = make_shaper is not None
    texts, ids = [[] for _ in range(n)], [[] for _ in range(n)]
    reasons, lps, scores = [None] * n, [None] * n, [0.0] * n
    fmts = [LogprobFormatter(state.tokenizer, chat) for _ in range(n)]
    async with aclosing(stream):
        async for piece in stream:
            i = piece.index
            texts[i].append(piece.text)
            if not piece.prompt:
                ids[i] += piece.ids
                scores[i] += sum(lp.logprob for lp in piece.logprobs)
            reasons[i] = piece.reason or reasons[i]
            if piece.logprobs:
                lps[i] = merge_logprobs(lps[i], fmts[i].format(piece.ids, piece.logprobs))
    choices = []
    for i in range(n):
        text, ids_out = "".join(texts[i]), ids[i] if body.return_token_ids else None
        if chat:
            shaper = make_shaper()
            message = shaper.message(text)  # parsed first: it decides the finish reason
            c = P.choice(True, False, "", shaper.finish_reason(reasons[i]), ids_out, logprobs=lps[i])
            c["message"] = message
        else:
            c = P.choice(False, False, text, reasons[i], ids_out, logprobs=lps[i])
        choices.append({**c, "index": i})
    if n > body.n:  # best_of
        best = sorted(range(n), key=lambda i: -scores[i])[: body.n]
        keep = body.logprobs is not None
        choices = [
            {**choices[i], "index": j, "logprobs": choices[i]["logprobs"] if keep else None}
            for j, i in enumerate(best)
        ]
    return {
        **P.envelope(rid, state.cfg.model_name, chat, False),
        "choices": choices,
        "usage": P.usage(len(prompt), sum(map(len, ids)), counts.cached_tokens),
    }


async def sse(state, rid: str, make_shaper, body, prompt_len: int, first, stream, n: int, counts: Counts):
    chat = make_shaper is not None
    head = P.envelope(rid, state.cfg.model_name, chat, True)
    fmts = [LogprobFormatter(state.tokenizer, chat) for _ in range(n)]
    shapers = [make_shaper() for _ in range(n)] if chat else []
    started, tokens, piece = set(), 0, first
    async with aclosing(stream):
        try:
            while True:
                yield _event({**head, "choices": [_chunk_choice(piece, body, fmts, shapers, started)]})
                tokens += 0 if piece.prompt else len(piece.ids)
                piece = await anext(stream)
        except StopAsyncIteration:
            pass
        except P.ApiError as e:  # after the first token: an error event ends the stream
            yield _event(P.error_body(e.message, e.type, e.param, e.code))
            return
    if body.stream_options is not None and body.stream_options.include_usage:
        yield _event({**head, "choices": [], "usage": P.usage(prompt_len, tokens, counts.cached_tokens)})
    yield "data: [DONE]\n\n"


def _chunk_choice(piece: Piece, body, fmts, shapers, started: set) -> dict:
    i = piece.index
    lps = fmts[i].format(piece.ids, piece.logprobs) if piece.logprobs else None
    ids = piece.ids if body.return_token_ids and not piece.prompt else None
    if not shapers:
        c = P.choice(False, True, piece.text, piece.reason, ids, logprobs=lps)
    else:
        delta = shapers[i].delta(piece.text, piece.reason is not None)  # first: it decides the reason
        c = P.choice(True, True, "", shapers[i].finish_reason(piece.reason), ids, logprobs=lps)
        c["delta"] = delta if i in started else {"role": "assistant", "content": "", **delta}
    started.add(i)
    return {**c, "index": i}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
