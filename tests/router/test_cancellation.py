"""A cancelled wait is cancelled, even when what it waited for comes at the same moment.

On Python 3.11 `asyncio.wait_for` returns an item that arrives as the waiting task is cancelled and
drops the cancellation (CPython gh-86296). The router waits on its events queue while a decode
streams tokens every few milliseconds, so a client that left mid-request was often not aborted: its
request decoded to the end (test_router_e2e's abandoned non-streaming request, one run in two).
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.orchestrator import next_event
from pdserve.router.pool import Pool


async def _cancel_as_it_arrives(wait, arrive):
    """Starts wait(), lets it block, then makes its item arrive and cancels it in the same step."""
    task = asyncio.create_task(wait())
    await asyncio.sleep(0)
    assert not task.done()
    arrive()
    task.cancel()
    return await task


def test_next_event_is_cancelled_even_when_an_event_arrives_with_the_cancel():
    async def main():
        q = asyncio.Queue()
        with pytest.raises(asyncio.CancelledError):
            await _cancel_as_it_arrives(lambda: next_event(q, 10), lambda: q.put_nowait(("token", 1)))
        assert q.qsize() == 1  # the event stays for whoever reads next

    asyncio.run(main())


def test_next_event_returns_events_and_times_out():
    async def main():
        q = asyncio.Queue()
        q.put_nowait(("token", 7))
        assert await next_event(q, 1) == ("token", 7)
        with pytest.raises(TimeoutError):
            await next_event(q, 0.05)

    asyncio.run(main())


def test_waiting_for_room_is_cancelled_even_when_room_comes_with_the_cancel():
    async def main():
        pool = Pool((), (), "round_robin")
        with pytest.raises(asyncio.CancelledError):
            await _cancel_as_it_arrives(lambda: pool.wait_for_room(10), pool.released)
        await pool.wait_for_room(0.05)  # no room: returns after its timeout

    asyncio.run(main())
