"""Prefill instance scheduler: the request lifecycle, as explicit queues (plain Python).

    submit() --> waiting --(pages for the prompt are free)--> prefilling --(first token)--> done
                   |                                             |
                   |                                             +--> transferring (hand-off: the
                   |                                                  rows go to the decode ranks,
                   |                                                  then the outcome; pages freed)
                   +--(abort, bootstrap timeout, or the prompt can never fit)--> failed

- waiting: accepted requests in arrival order. A hand-off request (`handoff=True`: its request id
  is the room a decode instance reserves on this instance's bootstrap side channel) is ready only
  once that reservation arrived; until then later requests may go first, and after
  `bootstrap_timeout_s` it fails. A decode abort (TransferFailed) of a waiting room fails it.
- prefilling: one request at a time runs on every rank; its chunks are already split across the
  ranks, and prefill is compute-bound, so running two at once would only interleave them.
- transferring: transfer/two_sided.serve_reserved plans, sends and answers the decode side with
  TransferDone (or TransferFailed) LAST, and releases the pages whatever happened.
- done: without a decode target the pages are released as soon as the first token is known.
Every request ends in exactly one of done (a first token) or failed (an error message).
The bootstrap side channel (BootstrapService) owns its socket in its own thread; run_once reads its
room tables and queues replies.

The scheduler decides; `PrefillInstance` executes. `run_once()` is driven by one worker thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..engine.page_allocator import OutOfPages
from ..engine.request import Overloaded, SamplingParams
from ..transfer.messages import TransferDone, TransferFailed
from ..transfer.side_channel import BootstrapServer
from ..transfer.two_sided import serve_reserved

DROPPED_KEEP_S = 600.0  # how long an aborted room waits for a late reservation to refuse
BOOTSTRAP_POLL_MS = 10  # with only hand-offs waiting for their reservation, how long one poll blocks

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
    on_done: Callable[["PrefillJob"], None] | None = None  # called once, from the worker thread
    handoff: bool = False  # ship the cache to the decode instance that reserves room = request_id
    bootstrap_timeout_s: float = 30.0
    first_token: int | None = None
    error: str | None = None
    state: JobState = JobState.waiting
    submitted: float = field(default_factory=time.monotonic)


class PrefillScheduler:
    def __init__(self, instance, bootstrap: BootstrapServer | None = None, max_queue: int = 256):
        self.instance, self.bootstrap, self.max_queue = instance, bootstrap, max_queue
        self.waiting: deque[PrefillJob] = deque()
        self.dropped: dict[str, float] = {}  # aborted hand-off room -> when: the worker tells its decode side
        self.current: PrefillJob | None = None
        self._cv = threading.Condition()
        self._stopped = False

    def submit(self, job: PrefillJob) -> PrefillJob:
        capacity = self.instance.allocator.num_pages * self.instance.allocator.page_size
        if len(job.token_ids) > capacity:
            raise ValueError(
                f"prompt of {len(job.token_ids)} tokens exceeds this instance's {capacity} KV slots"
            )
        if job.handoff and self.bootstrap is None:
            raise ValueError("this prefill instance has no bootstrap side channel for hand-offs")
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                raise Overloaded(f"the prefill queue is full ({self.max_queue} requests waiting)")
            self.waiting.append(job)
            self._cv.notify()
        return job

    def abort(self, request_id: str) -> bool:
        """Removes a request that has not started; a running prefill finishes and is then released."""
        with self._cv:
            for job in self.waiting:
                if job.request_id == request_id:
                    self.waiting.remove(job)
                    if job.handoff:
                        self.dropped[request_id] = time.monotonic()
                    self._finish(job, error="aborted")
                    return True
        return False

    def stop(self, reason: str | None = None) -> None:
        """Fails every waiting request with `reason`; the one running finishes (the worker then stops)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            while self.waiting:
                self._finish(self.waiting.popleft(), error=reason or "the prefill instance is shutting down")

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + (self.current is not None)

    def run_once(self, timeout: float = 0.5) -> bool:
        """Prefills the oldest ready request if its pages are free; False when nothing ran."""
        with self._cv:
            if not self.waiting and not self._stopped:
                self._cv.wait(timeout)
            if self._stopped or not self.waiting:
                return False
            job = self._next_ready()
            if job is None:
                handoffs_only = True
            else:
                self.waiting.remove(job)
                self.current, job.state, handoffs_only = job, JobState.prefilling, False
        if handoffs_only:  # every waiting request waits for its reservation: block on the socket briefly
            self.bootstrap.drain(BOOTSTRAP_POLL_MS)
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
        job.first_token = result.token
        self._finish(job)
        return True

    def _next_ready(self) -> PrefillJob | None:
        """(Under the lock.) The first waiting job that can run; fails hand-offs that timed out or
        that their decode instance aborted."""
        if self.bootstrap is not None:
            self._tidy_bootstrap()
        now = time.monotonic()
        for job in list(self.waiting):
            if not job.handoff:
                return job
            room = job.request_id
            if room in self.bootstrap.aborted:
                reason = self.bootstrap.aborted[room]
            elif self.bootstrap.claim(room) is not None:  # claimed: it no longer expires while the job waits
                return job
            elif now - job.submitted > job.bootstrap_timeout_s:
                reason = f"bootstrap timeout: no decode reservation for room {room} within {job.bootstrap_timeout_s} s"
            else:
                continue
            self.waiting.remove(job)
            self.bootstrap.forget(room)
            self._finish(job, error=reason)
        return None

    def _tidy_bootstrap(self) -> None:
        """Takes in reservations and aborts; answers rooms aborted here; forgets rooms the decode side
        gave up that have no job here (else their reservation would be kept forever). An aborted
        room whose reservation never came is dropped after DROPPED_KEEP_S: its decode side timed out."""
        self.bootstrap.drain()
        waiting = {j.request_id for j in self.waiting if j.handoff}
        now = time.monotonic()
        for room, since in list(self.dropped.items()):
            if room in self.bootstrap.reservations:
                self.bootstrap.reply(TransferFailed(room, "aborted by the prefill instance"))
                del self.dropped[room]
            elif now - since > DROPPED_KEEP_S:
                del self.dropped[room]
        for room in list(self.bootstrap.aborted):
            if room not in waiting:
                self.bootstrap.forget(room)
                self.dropped.pop(room, None)

    def _run_handoff(self, job: PrefillJob) -> bool:
        if not self.instance.allocator.can_allocate(len(job.token_ids)):
            self._requeue(job)
            return False
        reservation = self.bootstrap.claim(job.request_id)  # kept now: never expired under the hand-off
        if reservation is None:  # it expired (or was forgotten) since _next_ready saw it
            self.current = None
            self._finish(job, error=f"the decode reservation of room {job.request_id} expired")
            return True
        job.state = JobState.transferring
        outcome = serve_reserved(self.instance, self.bootstrap, reservation, job.token_ids, job.params)
        self.current = None
        if isinstance(outcome, TransferDone):
            job.first_token = outcome.first_token
            self._finish(job)
        else:
            self._finish(job, error=outcome.reason)
        return True

    def fail_current(self, reason: str) -> None:
        """The worker's last resort after an unexpected error: the running job fails, its pages go back."""
        job, self.current = self.current, None
        if job is not None and job.state not in (JobState.done, JobState.failed):
            try:
                self.instance.release(job.request_id)
            except Exception:  # nothing held, or the ranks are gone (the watchdog's case)
                pass
            self._finish(job, error=reason)

    def _requeue(self, job: PrefillJob) -> None:
        with self._cv:
            self.waiting.appendleft(job)
            job.state, self.current = JobState.waiting, None

    def _finish(self, job: PrefillJob, error: str | None = None) -> None:
        job.state, job.error = (JobState.failed, error) if error else (JobState.done, None)
        if job.on_done:
            job.on_done(job)
