"""The prefill loop thread: the only code that touches the prefill instance (serving/instance_loop.py).

Each iteration takes the queued submit / abort commands, then lets the scheduler prefill the
oldest ready request (scheduler.py: its lifecycle). A request's outcome is one event for its
listener: Token(first token) then Finished("length"), or Failed(message).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from ..serving.instance_loop import IDLE_WAIT_S, Failed, Finished, InstanceLoop, Listener, Submit, Token
from ..transfer.side_channel import BootstrapServer
from .scheduler import JobState, PrefillJob, PrefillScheduler

PAGES_WAIT_S = 0.01  # the next request's pages are held by hand-offs in flight: wait this long for them

log = logging.getLogger("pdserve.prefill")


class PrefillLoop(InstanceLoop):
    """submit(), abort(), busy() and stop() are thread-safe; the rest runs on the loop thread."""

    role = "prefill"

    def __init__(
        self, instance, bootstrap: BootstrapServer | None = None, max_queue: int = 256, on_fatal=None
    ):
        super().__init__(on_fatal)
        self.instance, self.bootstrap = instance, bootstrap
        self.scheduler = PrefillScheduler(instance, bootstrap, max_queue, on_finish=self._finished)

    def submit(self, job: PrefillJob, listener: Listener) -> Future:
        return self.put_submit(job.request_id, listener, job)

    def iterate(self) -> None:
        s = self.scheduler
        self.take_commands(0.0 if s.waiting else IDLE_WAIT_S)
        if not s.waiting or self._stop.is_set():
            return
        try:
            ran = s.run_once()
        except (
            Exception
        ) as e:  # a bug must cost the request at hand, never the thread that serves all of them
            log.exception("prefill loop: unexpected error")
            s.fail_current(f"internal error: {type(e).__name__}: {e}")
            return
        if not ran and (s.blocked_on_pages or s.blocked_on_grammars):
            self.take_commands(PAGES_WAIT_S)  # waiting for pages held by hand-offs in flight, or grammars

    def accept(self, cmd: Submit) -> None:
        self.scheduler.submit(cmd.payload)

    def cancel(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def _finished(self, job: PrefillJob) -> None:
        if job.state is JobState.done:
            self.emit(job.request_id, Token(job.first_token))
            self.emit(job.request_id, Finished("length"))
        else:
            self.emit(job.request_id, Failed(job.error))

    def fail_all(self, message: str) -> None:
        try:
            self.scheduler.stop(message)  # fails the waiting requests, telling their decode rooms
        except Exception:  # the ranks or the side channel are gone: the listeners still get the error
            log.exception("prefill loop: failing the waiting requests")
        self.fail_listeners(message)

    def close(self) -> None:
        if self.bootstrap is not None:
            self.bootstrap.close()  # after the last iteration: it may have been answering a room
