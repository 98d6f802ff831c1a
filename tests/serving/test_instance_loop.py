"""The loop skeleton both servers share (serving/instance_loop.py), with a plain-Python role: the
command queue's answers, the listener events, abort, stop and what arrives after the loop closed."""

from __future__ import annotations

import threading

import pytest

from pdserve.request import Overloaded
from pdserve.serving.instance_loop import (
    IDLE_WAIT_S,
    Failed,
    Finished,
    InstanceLoop,
    Submit,
    Token,
    Unavailable,
)


class CountingLoop(InstanceLoop):
    """A role whose request (payload n) yields tokens 0..n-1, one per iteration, then finishes."""

    role = "test"

    def __init__(self, max_queue: int = 2):
        super().__init__()
        self.max_queue, self.left, self.owner = max_queue, {}, set()

    def iterate(self) -> None:
        self.take_commands(0.0 if self.left else IDLE_WAIT_S)
        self.owner.add(threading.current_thread().name)
        for rid, (sent, n) in list(self.left.items()):
            self.emit(rid, Token(sent))
            self.left[rid] = (sent + 1, n)
            if sent + 1 == n:
                del self.left[rid]
                self.emit(rid, Finished("length"))

    def accept(self, cmd: Submit) -> None:
        if cmd.payload < 1:
            raise ValueError("payload must be >= 1")
        if len(self.left) >= self.max_queue:
            raise Overloaded("full")
        self.left[cmd.request_id] = (0, cmd.payload)  # (tokens sent, tokens to send)

    def cancel(self, request_id: str) -> bool:
        return self.left.pop(request_id, None) is not None


def collect():
    events, ended = [], threading.Event()

    def on(ev):
        events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            ended.set()

    return events, ended, on


def test_events_abort_refusals_and_stop():
    loop = CountingLoop()
    loop.start()
    try:
        events, ended, on = collect()
        assert loop.put_submit("a", on, 3).result(5) is None
        assert ended.wait(5) and events == [Token(0), Token(1), Token(2), Finished("length")]
        assert loop.owner == {"test-loop"}  # only the loop thread ran the role
        with pytest.raises(ValueError, match=">= 1"):
            loop.put_submit("bad", on, 0).result(5)
        assert "bad" not in loop.listeners  # a refused request leaves no listener behind

        long_events, long_ended, on_long = collect()
        loop.put_submit("long", on_long, 10**9).result(5)
        with pytest.raises(ValueError, match="already in use"):
            loop.put_submit("long", on, 1).result(5)
        loop.put_submit("other", lambda ev: None, 10**9).result(5)
        with pytest.raises(Overloaded):
            loop.put_submit("third", on, 10**9).result(5)
        assert loop.abort("long").result(5) is True and long_ended.wait(5)
        assert long_events[-1] == Finished("abort")
        assert loop.abort("long").result(5) is False and loop.busy() == 1

        last_events, last_ended, on_last = collect()
        loop.put_submit("last", on_last, 10**9).result(5)
    finally:
        loop.stop("going away")
        loop.join(5)
    assert last_ended.is_set() and last_events[-1] == Failed("going away", instance_failed=True)
    assert not loop.listeners and loop.busy() == 0
    with pytest.raises(Unavailable):  # the loop closed: answered at once, never left waiting
        loop.put_submit("late", on, 1).result(1)
    assert loop.abort("late").result(1) is False


def test_a_failing_iteration_fails_every_request_and_calls_on_fatal():
    fatal = []

    class Broken(CountingLoop):
        def iterate(self) -> None:
            super().iterate()
            if self.left:
                raise RuntimeError("rank 1 died")

    loop = Broken()
    loop.on_fatal = fatal.append
    loop.start()
    events, ended, on = collect()
    loop.put_submit("a", on, 5).result(5)
    assert ended.wait(5) and events[-1] == Failed(
        "test step failed: RuntimeError: rank 1 died", instance_failed=True
    )
    loop.join(5)
    assert fatal == ["test step failed: RuntimeError: rank 1 died"]


def test_call_runs_on_the_loop_thread_and_is_refused_after_stop():
    """`call` (the prefix-cache flush): the function runs on the loop thread, its result or its
    exception comes back in the Future; once the loop has stopped it is refused (503)."""
    loop = CountingLoop()
    loop.start()
    try:
        assert loop.call(lambda: threading.current_thread().name).result(5) == "test-loop"
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda: 1 / 0).result(5)
        assert loop.call(lambda: 7).result(5) == 7  # a raising call does not stop the loop
    finally:
        loop.stop()
        loop.join(5)
    with pytest.raises(Unavailable):
        loop.call(lambda: 0).result(5)


def test_a_role_missing_a_method_cannot_be_built():
    class NoCancel(InstanceLoop):
        def iterate(self) -> None: ...

        def accept(self, cmd: Submit) -> None: ...

    with pytest.raises(TypeError, match="cancel"):
        NoCancel()
