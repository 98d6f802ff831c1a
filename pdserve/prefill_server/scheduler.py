"""Prefill instance scheduler: the request lifecycle, as explicit queues (plain Python).

    submit() --> waiting --(pages for the prompt are free)--> prefilling --(first token)--> done
                   |                                             |
                   |                                             +--> transferring (hand-off: the
                   |                                                  rows go to the decode ranks,
                   |                                                  then the outcome; pages freed)
                   +--(abort, bootstrap timeout, or the prompt can never fit)--> failed

- waiting: accepted requests in arrival order. A hand-off request (`handoff=True`: its request id
  is the room a decode instance reserves on this instance's bootstrap side channel) has a
  `PrefillRoom` (transfer/prefill_room.py, the hand-off state machine) and is ready only once the
  room claimed its reservation; until then later requests may go first, and after
  `bootstrap_timeout_s`, or on a decode abort, the room fails and so does the request.
- prefilling: one request at a time runs on every rank; its chunks are already split across the
  ranks, and prefill is compute-bound, so running two at once would only interleave them.
- transferring: the room's run() prefills, plans, sends and answers the decode side with
  TransferDone (or TransferFailed) LAST, and releases the pages whatever happened.
- done: without a decode target the pages are released as soon as the first token is known.
Every request ends in exactly one of done (a first token) or failed (an error message).
The bootstrap side channel (BootstrapService) owns its socket in its own thread; the rooms read its
tables and queue replies.

The scheduler decides; `PrefillInstance` executes. Only the prefill loop thread (loop.py, the
skeleton of serving/instance_loop.py) calls it: submit() and abort() arrive there as commands, and
`run_once()` is called once per loop iteration; `on_finish(job)` tells the loop a request ended.
Through the HTTP API (http_api.py): the handler checks the body, then submits it to the loop thread
(which alone owns the scheduler and the instance) and waits for its events: the accept (400 when
the prompt can never fit, 429 when the queue is full, 503 while shutting down), then the first token
and the finish, or an error. A client that leaves while its request waits aborts it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..kvcache.page_allocator import OutOfPages
from ..request import Overloaded, SamplingParams
from ..transfer.base import KVPoll
from ..transfer.messages import TransferDone
from ..transfer.prefill_room import PrefillRooms
from ..transfer.side_channel import BootstrapServer

BOOTSTRAP_POLL_MS = 10  # with only hand-offs waiting for their reservation, how long one poll blocks
# (it returns as soon as a side-channel message arrives)

_ids = itertools.count()
log = logging.getLogger("pdserve.prefill")


class JobState(str, Enum):
    """A prefill request's lifecycle, as drawn in the module docstring."""

    waiting = "waiting"
    prefilling = "prefilling"
    transferring = "transferring"  # hand-off requests only
    done = "done"
    failed = "failed"


@dataclass
class PrefillJob:
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"prefill-{next(_ids)}")
    chunk_size: int | None = None
    handoff: bool = False  # ship the cache to the decode instance that reserves room = request_id
    bootstrap_timeout_s: float = 30.0
    first_token: int | None = None
    prompt_logprobs: list | None = None  # [TokenLogprob | None] per position, with params.prompt_logprobs
    cached_tokens: int = 0  # leading prompt tokens read from the prefix cache, not computed
    error: str | None = None
    state: JobState = JobState.waiting
    submitted: float = field(default_factory=time.monotonic)


class PrefillScheduler:
    def __init__(
        self,
        instance,
        bootstrap: BootstrapServer | None = None,
        max_queue: int = 256,
        on_finish: Callable[[PrefillJob], None] | None = None,
    ):
        self.instance, self.bootstrap, self.max_queue = instance, bootstrap, max_queue
        self.on_finish = on_finish  # called once per request, when it reaches done or failed
        self.waiting: deque[PrefillJob] = deque()
        self.rooms = PrefillRooms(instance, bootstrap) if bootstrap is not None else None
        self.blocked_on_pages = False  # the last run_once found the next request's pages held
        self.blocked_on_grammars = False  # ... found every waiting request's grammar compiling
        self.current: PrefillJob | None = None

    def submit(self, job: PrefillJob) -> PrefillJob:
        capacity = self.instance.allocator.num_pages * self.instance.allocator.page_size
        if len(job.token_ids) > capacity:
            raise ValueError(
                f"prompt of {len(job.token_ids)} tokens exceeds this instance's {capacity} KV slots"
            )
        if job.handoff and self.bootstrap is None:
            raise ValueError("this prefill instance has no bootstrap side channel for hand-offs")
        if len(self.waiting) >= self.max_queue:
            raise Overloaded(f"the prefill queue is full ({self.max_queue} requests waiting)")
        if job.handoff:
            self.rooms.open(job.request_id, job.token_ids, job.params, job.bootstrap_timeout_s)
        if job.params.grammar is not None:  # compiles in the background while the job waits
            self.instance.grammars.prepare(job.params.grammar)
        self.waiting.append(job)
        return job

    def abort(self, request_id: str) -> bool:
        """Removes a request that has not started; a running prefill finishes and is then released."""
        for job in self.waiting:
            if job.request_id == request_id:
                self.waiting.remove(job)
                if job.handoff:
                    self.rooms.abort(request_id)
                self._finish(job, error="aborted")
                return True
        return False

    def stop(self, reason: str | None = None) -> None:
        """Fails every waiting request with `reason` (the running one has finished: same thread)."""
        reason = reason or "the prefill instance is shutting down"
        while self.waiting:
            job = self.waiting.popleft()
            if job.handoff:
                self.rooms.abort(job.request_id, reason)
            self._finish(job, error=reason)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + (self.current is not None)

    def run_once(self) -> bool:
        """Prefills the oldest ready request if its pages are free; False when nothing ran."""
        if not self.waiting:
            return False
        job = self._next_ready()
        self.blocked_on_pages = False
        if job is not None:
            self.waiting.remove(job)
            self.current, job.state = job, JobState.prefilling
        if job is None:  # every waiting request waits for its reservation or its grammar
            if self.bootstrap is not None:  # block on the socket briefly (the loop need not wait too)
                self.bootstrap.drain(BOOTSTRAP_POLL_MS)
                self.blocked_on_grammars = False
            return False
        if job.handoff:
            return self._run_handoff(job)
        try:
            result = self.instance.prefill(job.request_id, job.token_ids, job.params, job.chunk_size)
        except OutOfPages:
            self._requeue(job)  # other requests hold the pages: try again when they are released
            return False
        except Exception as e:  # this request fails; a dead rank or a broken group is the watchdog's
            self.current = None
            log.error("prefill of %s failed: %s\n%s", job.request_id, e, getattr(e, "traceback", ""))
            self._finish(job, error=f"{type(e).__name__}: {e}")
            return True
        self.instance.release(job.request_id)  # no decode target: nothing to hand off
        self.current = None
        job.first_token, job.prompt_logprobs = result.token, result.prompt_logprobs
        job.cached_tokens = result.cached_len
        self._finish(job)
        return True

    def _next_ready(self) -> PrefillJob | None:
        """The first waiting job that can run; fails hand-offs whose room failed
        (bootstrap timeout, decode abort) and jobs whose grammar failed to compile. A job whose
        grammar still compiles (engine/constraint.py, in the background) lets later ones go first."""
        if self.rooms is not None:
            self.rooms.tidy()
        self.blocked_on_grammars = False
        for job in list(self.waiting):
            if not self._grammar_ready(job):
                self.blocked_on_grammars |= job in self.waiting  # still compiling (not failed)
                continue
            if not job.handoff:
                return job
            room = self.rooms.get(job.request_id)
            state = room.poll()
            if state is KVPoll.WaitingForInput:
                return job
            if state is KVPoll.Failed:
                self.waiting.remove(job)
                self.rooms.close(job.request_id)
                self._finish(job, error=room.s.reason)
        return None

    def _grammar_ready(self, job: PrefillJob) -> bool:
        if job.params.grammar is None:
            return True
        try:
            return self.instance.grammars.ready(job.params.grammar)
        except Exception as e:  # GrammarError: its compile failed or ran out of time
            self.waiting.remove(job)
            if job.handoff:
                self.rooms.abort(job.request_id, str(e))
            self._finish(job, error=str(e))
            return False

    def _run_handoff(self, job: PrefillJob) -> bool:
        if not self.instance.allocator.can_allocate(len(job.token_ids)):
            self._requeue(job)
            return False
        job.state = JobState.transferring
        room = self.rooms.get(job.request_id)
        outcome = room.run()
        self.rooms.close(job.request_id)
        if room.result is not None:
            job.prompt_logprobs, job.cached_tokens = room.result.prompt_logprobs, room.result.cached_len
        self.current = None
        if isinstance(outcome, TransferDone):
            job.first_token = outcome.first_token
            self._finish(job)
        else:
            self._finish(job, error=outcome.reason)
        return True

    def fail_current(self, reason: str) -> None:
        """The loop's last resort after an unexpected error: the running job fails, its pages go back."""
        job, self.current = self.current, None
        if job is not None and job.state not in (JobState.done, JobState.failed):
            try:
                if job.handoff:
                    self.rooms.abort(job.request_id, reason)  # releases, and tells the decode side
                self.instance.release(job.request_id)
            except Exception:  # nothing held, or the ranks are gone (the watchdog's case)
                pass
            self._finish(job, error=reason)

    def _requeue(self, job: PrefillJob) -> None:
        self.waiting.appendleft(job)
        job.state, self.current, self.blocked_on_pages = JobState.waiting, None, True

    def _finish(self, job: PrefillJob, error: str | None = None) -> None:
        job.state, job.error = (JobState.failed, error) if error else (JobState.done, None)
        if self.on_finish:
            self.on_finish(job)
