"""Prefill instance scheduler: the request lifecycle, as explicit queues (plain Python).

    submit() --> waiting --(pages for the prompt are free)--> prefilling --(first token)--> done
                   |                                             |
                   |                                             +--> transferring (issue 5: the
                   |                                                  cache is held until the
                   |                                                  hand-off succeeds or fails)
                   +--(abort, or the prompt can never fit)--> failed

- waiting: accepted requests in arrival order. A request that names a decode target will also
  wait here for the decode instance's page reservation (bootstrap) once the hand-off lands.
- prefilling: one request at a time runs on every rank; its chunks are already split across the
  ranks, and prefill is compute-bound, so running two at once would only interleave them.
- done: without a decode target the pages are released as soon as the first token is known.
Every request ends in exactly one of done (a first token) or failed (an error message).

The scheduler decides; `PrefillInstance` executes. `run_once()` is driven by one worker thread.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.page_allocator import OutOfPages
from ..engine.request import SamplingParams

_ids = itertools.count()


@dataclass
class PrefillJob:
    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"prefill-{next(_ids)}")
    chunk_size: int | None = None
    on_done: Callable[["PrefillJob"], None] | None = None  # called once, from the worker thread
    first_token: int | None = None
    error: str | None = None
    state: str = "waiting"  # waiting | prefilling | done | failed


class PrefillScheduler:
    def __init__(self, instance):
        self.instance = instance
        self.waiting: deque[PrefillJob] = deque()
        self.current: PrefillJob | None = None
        self._cv = threading.Condition()
        self._stopped = False

    def submit(self, job: PrefillJob) -> PrefillJob:
        capacity = self.instance.allocator.num_pages * self.instance.allocator.page_size
        if len(job.token_ids) > capacity:
            raise ValueError(f"prompt of {len(job.token_ids)} tokens exceeds this instance's {capacity} KV slots")
        with self._cv:
            self.waiting.append(job)
            self._cv.notify()
        return job

    def abort(self, request_id: str) -> bool:
        """Removes a request that has not started; a running prefill finishes and is then released."""
        with self._cv:
            for job in self.waiting:
                if job.request_id == request_id:
                    self.waiting.remove(job)
                    self._finish(job, error="aborted")
                    return True
        return False

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            while self.waiting:
                self._finish(self.waiting.popleft(), error="the prefill instance is shutting down")

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + (self.current is not None)

    def run_once(self, timeout: float = 0.5) -> bool:
        """Prefills the oldest waiting request if its pages are free; False when idle or stopped."""
        with self._cv:
            if not self.waiting and not self._stopped:
                self._cv.wait(timeout)
            if self._stopped or not self.waiting:
                return False
            job = self.waiting.popleft()
            self.current, job.state = job, "prefilling"
        try:
            result = self.instance.prefill(job.request_id, job.token_ids, job.params, job.chunk_size)
        except OutOfPages:
            with self._cv:  # other requests hold the pages: try again when they are released
                self.waiting.appendleft(job)
                job.state, self.current = "waiting", None
            return False
        except Exception as e:  # a rank failure is reported to this request; the watchdog handles the instance
            self.current = None
            self._finish(job, error=f"{type(e).__name__}: {e}")
            return True
        self.instance.release(job.request_id)  # no decode target yet: nothing to hand off
        self.current = None
        job.first_token = result.token
        self._finish(job)
        return True

    def _finish(self, job: PrefillJob, error: str | None = None) -> None:
        job.state, job.error = ("failed", error) if error else ("done", None)
        if job.on_done:
            job.on_done(job)
