"""The decode loop thread: the only code that touches the decode instance (serving/instance_loop.py).

Each iteration takes the queued submit / abort commands, polls the KV hand-offs in flight
(decode_server/handoff_rooms.py), runs one decode step (admission, then one token for every running
request: decode_server/step_driver.py) and reserves the rooms it admitted in the same iteration.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

from ..request import Overloaded, SamplingParams, choice_id
from ..runtime.faults import step_delay
from ..serving.instance_loop import (
    IDLE_WAIT_S,
    Event,
    Failed,
    Finished,
    InstanceLoop,
    Listener,
    Submit,
    Token,
)
from ..transfer.frames import DEV_FRAME_KEY
from .destination import DriverDestination
from .handoff_rooms import DecodeRooms
from .step_driver import DecodeStepDriver

TRANSFER_POLL_S = 0.002  # with nothing to decode, how often pending hand-offs are polled


@dataclass
class DecodeSubmit:
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: (
        str | None
    )  # a prefill's side channel: the cache comes by KV hand-off (decode_server/handoff_rooms.py)


class DecodeLoop(InstanceLoop):
    """submit(), abort(), busy() and stop() are thread-safe; `stats` is a snapshot readers need no lock for."""

    role = "decode"

    def __init__(
        self,
        driver: DecodeStepDriver,
        on_fatal=None,
        transfer_timeout_s: float = 30.0,
        heartbeat_timeout_s: float = 5.0,
        max_queue: int = 256,
        frame_key: bytes = DEV_FRAME_KEY,
    ):
        super().__init__(on_fatal)
        self.driver, self.max_queue = driver, max_queue
        self.remote = DecodeRooms(
            DriverDestination(driver), self.emit, transfer_timeout_s, heartbeat_timeout_s, frame_key
        )
        self.stats = self._snapshot()  # replaced (never mutated) after every iteration

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        listener: Listener,
        bootstrap: str | None = None,
    ) -> Future:
        return self.put_submit(request_id, listener, DecodeSubmit(list(prompt_ids), params, bootstrap))

    def iterate(self) -> None:
        s = self.driver.scheduler
        # idle: sleep on the queue; only waiting for hand-offs: short naps; decoding: don't wait
        self.take_commands(IDLE_WAIT_S if s.is_idle() else TRANSFER_POLL_S if not s.running else 0.0)
        self.remote.poll()
        if not s.is_idle() or self.driver.pending:  # pending: choices a hand-off started
            step_delay()  # test-only, off by default (runtime/faults.py)
            self._dispatch(self.driver.step())  # admits: rooms it admitted are reserved now
            self.remote.reserve_admitted()
            if self.driver.grammar_wait:  # every running request waits for its grammar's compile
                self.take_commands(TRANSFER_POLL_S)
        else:
            self.driver.forget_ended()  # rank 0's generators of requests aborted since the last step
        self.stats = self._snapshot()

    def accept(self, cmd: Submit) -> None:
        req: DecodeSubmit = cmd.payload
        if len(self.driver.scheduler.queued) >= self.max_queue:
            raise Overloaded(f"the decode queue is full ({self.max_queue} requests waiting)")
        if req.bootstrap:
            self.remote.submit(
                cmd.request_id, len(req.prompt_ids), req.params, req.bootstrap, prompt_ids=req.prompt_ids
            )
        else:
            try:  # without a cache the driver prefills locally, here on this thread (the KV hand-off replaces it)
                self.driver.submit(req.prompt_ids, req.params, cmd.request_id)
            except Exception:
                self.driver.abort(cmd.request_id)  # a failed local prefill must not leave the request queued
                raise
        for i in range(1, req.params.n):  # choice i's events reach the request's listener tagged with i
            self.listeners[choice_id(cmd.request_id, i)] = _tagged(cmd.listener, i)

    def cancel(self, request_id: str) -> bool:
        was_remote = self.remote.abort(request_id)  # tells the prefill, forgets the room on the ranks
        was_local = self.driver.abort(request_id) is not None  # frees its pages at once (every choice's)
        for rid in self._choices(request_id):  # the request's own finish comes from the caller
            self.emit(rid, Finished("abort"))
        return was_remote or was_local

    def emit(self, request_id: str, event: Event) -> None:
        """A failed hand-off's error is every choice's too: none of them started."""
        if isinstance(event, Failed):
            for rid in self._choices(request_id):
                super().emit(rid, event)
        super().emit(request_id, event)

    def _choices(self, request_id: str) -> list[str]:
        """Live listeners of choices 1.. of a request (ids never contain "/": choice i's is id/i)."""
        return [rid for rid in self.listeners if rid.startswith(request_id + "/")]

    def _dispatch(self, events) -> None:
        ended = {}
        left = Counter(req.request_id for req, token in events if token is not None)
        for req, token in events:  # a request's end follows all of its tokens of this step
            if token is not None:
                left[req.request_id] -= 1  # this step's tokens are the request's last ones, in order
                self.emit(req.request_id, Token(token, req.logprob_wire(left[req.request_id])))
            if req.state == "failed":  # computing it raised: only this request ends (step_driver.step)
                ended[req.request_id] = Failed(f"decode step failed: {req.error}")
            elif req.state in ("finished", "aborted"):
                ended[req.request_id] = Finished(req.finish_reason)
        for request_id, event in ended.items():
            self.emit(request_id, event)

    def fail_all(self, message: str) -> None:
        for room in list(self.remote.rooms):
            try:
                self.remote.abort(room)
            except Exception:  # the ranks are gone: nothing left to forget on them
                pass
        for request_id in list(self.listeners):
            self.driver.abort(request_id)
        self.fail_listeners(message)

    def close(self) -> None:
        self.remote.close()

    def _snapshot(self) -> dict:
        s, alloc = self.driver.scheduler, self.driver.instance.allocator
        return {
            "free_tokens": alloc.num_free * alloc.page_size,
            "held_tokens": alloc.num_held * alloc.page_size,
            "running": len(s.running),
            "queued": len(s.queued) + len(s.waiting_for_kv),
            "transfers_pending": len(self.remote.rooms),
            "transfers_completed": self.remote.completed,
            "transfers_failed": self.remote.failed,
            "transfer_bytes": self.remote.bytes_received,
            "transfer_seconds": self.remote.transfer_seconds,
            **self.driver.instance.cache_counters(),
        }


def _tagged(listener: Listener, index: int) -> Listener:
    """Events of choice `index` carry that index (decode http_api._stream)."""
    return lambda ev: listener(dataclasses.replace(ev, index=index))
