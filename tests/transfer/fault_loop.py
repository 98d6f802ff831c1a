"""The seeded mixed-fault loop over the production hand-off machines (tests/transfer/handoff_driver.py)
with real rank processes: each case is, at random, a success or one fault, and every failure must
name its cause. The caller checks afterwards that both sides are exactly idle (assert_idle).

Faults: a corrupted payload; rows that never arrive; a refused fingerprint; the decode side dropping
the room while the prefill sends (its rows then land late: over NIXL in the room's pages, which the
quarantine holds -- the hold is checked to be taken here, and to expire by assert_idle); an abort
from either side in every state a side can abort in; a prefill failing after it sent. Room ids come
from a small pool, so they are reused while late rows of an earlier use may still arrive. Half the
cases stream their rows (sent while the prefill computes them), half send them after it. Once per
loop: a prefill that stops heart-beating (its side channel closes under an open room); after the
loop (`rank_killed_case`): a prefill rank killed as its room's send starts.
"""

from __future__ import annotations

import os
import random
import signal
import time

from pdserve.request import SamplingParams
from pdserve.transfer.base import KVPoll
from pdserve.transfer.prefill_room import PrefillRoom
from pdserve.transfer.side_channel import BootstrapService
from tests.transfer.handoff_driver import Driver, FaultySource, TransferError
from tests.transfer.handoff_helpers import assert_idle

KINDS = {  # kind -> what the failure must say (None: it succeeds)
    "ok": None,
    "corrupt": "checksum mismatch",
    "never": "transfer timeout",
    "fingerprint": "model_dtype",
    "decode drops mid-send": "aborted by the decode instance",
    "decode abort bootstrapping": "aborted by the decode instance",
    "decode abort waiting": "aborted by the decode instance",
    "prefill abort bootstrapping": "aborted by the prefill instance",
    "prefill abort waiting": "aborted by the prefill instance",
    "prefill fails after send": "failed mid-send",
}
ROOMS = [f"r{i}" for i in range(6)]


def _wait(cond, what: str, driver: Driver, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while not cond():
        assert time.monotonic() < deadline, what
        driver.rooms.poll()
        driver.prefill_rooms.tidy()
        driver.server.drain(2)


def run_case(driver: Driver, kind: str, room: str, ids: list[int], quarantine: bool, stream: bool = False):
    """One case; raises TransferError for a failed hand-off (after both sides released it).
    stream: the prefill streams the rows (prefill_send), except where they must never come.
    A success returns its decode request (finished: its one greedy token)."""
    prefill, rooms = driver.prefill, driver.rooms
    params = SamplingParams(max_tokens=1)
    if kind == "decode abort bootstrapping":  # before its reservation went out
        d = rooms.submit(room, len(ids), params, driver.server.endpoint)
        assert d.state is KVPoll.Bootstrapping and rooms.abort(room) and d.state is KVPoll.Failed
        raise TransferError(room, d.s.reason)
    source = FaultySource(
        prefill,
        corrupt=kind == "corrupt",
        skip_send=kind == "never",
        dtype="float32" if kind == "fingerprint" else None,
        stream_handoff=stream and kind != "never",
    )
    if kind == "decode drops mid-send":
        source.before_send = lambda r: _drop(driver, r, quarantine)
    if kind == "prefill fails after send":
        source.after_send = _fail_after_send
    p = driver.prefill_rooms.open(room, ids, params, bootstrap_timeout_s=30)
    p.source = source
    if kind == "prefill abort bootstrapping":  # aborted here before the reservation came: refused late
        assert driver.prefill_rooms.abort(room) and p.state is KVPoll.Failed
    d = driver.submit(ids, params, room, timeout_s=0.1 if kind == "never" else 30)
    if kind != "prefill abort bootstrapping":
        assert driver.claim(p, d) is KVPoll.WaitingForInput, (kind, p.s.reason, d.s.reason)
    if kind == "decode abort waiting":
        assert rooms.abort(room) and d.state is KVPoll.Failed
        _wait(lambda: p.poll() is KVPoll.Failed, "the prefill never heard of the abort", driver)
        driver.prefill_rooms.close(room)
        raise TransferError(room, d.s.reason)
    if kind == "prefill abort waiting":
        assert driver.prefill_rooms.abort(room)
    elif p.state is KVPoll.WaitingForInput:
        p.run()
    driver.prefill_rooms.close(room)
    if kind == "decode drops mid-send":
        assert d.state is KVPoll.Failed
        raise TransferError(room, d.s.reason)
    return driver.finish(d)


def _drop(driver: Driver, room: str, quarantine: bool) -> None:
    """The decode side drops the room just before the prefill sends (its rows then arrive late)."""
    alloc = driver.decode.instance.allocator
    held = alloc.num_held
    assert driver.rooms.abort(room)
    if quarantine:  # one-sided WRITEs may still land in the pages: the quarantine holds them
        assert alloc.num_held > held, "a room dropped mid-send over NIXL must hold its pages"


def _fail_after_send(room: str) -> None:
    raise RuntimeError("the prefill failed mid-send")


def heartbeat_case(driver: Driver, ids: list[int]) -> None:
    """A prefill whose side channel dies after it claimed the room: the decode room fails by heartbeat
    timeout, and the prefill's rows are released."""
    other = BootstrapService()
    room = "heartbeat"
    try:
        d = driver.submit(ids, SamplingParams(max_tokens=1), room, timeout_s=30, bootstrap=other.endpoint)
        p = PrefillRoom(driver.prefill, other, room, ids, bootstrap_timeout_s=10)
        deadline = time.monotonic() + 10
        while p.poll() is KVPoll.Bootstrapping:
            assert time.monotonic() < deadline
            driver.rooms.poll()
            other.drain(2)
    finally:
        other.close()  # the prefill process is gone: no heartbeats, no outcome
    try:
        driver.finish(d, wait_s=driver.rooms.heartbeat_timeout_s + 10)
        raise AssertionError("a silent prefill must fail the room")
    except TransferError as e:
        assert "stopped answering" in e.reason, e.reason
    assert p.abort("the side channel closed") and not driver.prefill.held


def run_mixed_faults(
    driver: Driver, cases: int, seed: int, quarantine: bool, prompt=None, first_token=None
) -> dict[str, int]:
    """prompt(rng) -> token ids (default: random, 1-30 tokens); first_token(ids) -> the greedy first
    token a success must have decoded (the single-rank engine's), or None: not checked."""
    rng = random.Random(seed)
    _prompt_of = prompt or _prompt
    counts = dict.fromkeys(KINDS, 0)
    beat_at = rng.randrange(cases)
    for i in range(cases):
        if i == beat_at:
            heartbeat_case(driver, _prompt_of(rng))
        kind, room = rng.choice(list(KINDS)), rng.choice(ROOMS)
        ids = _prompt_of(rng)
        try:
            req = run_case(driver, kind, room, ids, quarantine, stream=rng.random() < 0.5)
            assert KINDS[kind] is None, f"{kind} succeeded"
            if first_token is not None:
                assert req.output_ids == [first_token(ids)], (kind, room, ids, req.output_ids)
        except TransferError as e:
            assert KINDS[kind] and KINDS[kind] in e.reason, (kind, e.reason)
        counts[kind] += 1
    driver.decode.run_until_idle()
    assert all(counts.values()), counts
    return counts


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(4, 500) for _ in range(rng.randint(1, 30))]


def rank_killed_case(instances, decode, transfer: str, pshape: tuple[int, str]) -> None:
    """A prefill rank dies as its instance starts sending a room (the other ranks send their share):
    the room fails on both sides -- the decode side holds the pages (a surviving rank may still
    write) -- and the broken prefill instance is shut down (the next user starts a fresh one)."""
    prefill = instances.get_prefill(*pshape, transfer=transfer)
    driver = Driver(prefill, decode)
    victim = prefill.ranks.pids[-1]
    source = FaultySource(prefill, before_send=lambda room: os.kill(victim, signal.SIGKILL))
    try:
        driver.hand_off(_prompt(random.Random(7)), SamplingParams(max_tokens=1), source=source)
        raise AssertionError("a hand-off whose prefill rank died must fail")
    except TransferError as e:
        assert "prefill failed: RankError" in e.reason, e.reason
        if transfer == "nixl":  # the surviving rank's WRITEs may still land: the pages stay held
            assert decode.instance.allocator.num_held > 0, "pages freed while a sender may still write"
    finally:
        driver.close()
        del instances.prefill[transfer, *pshape]
        prefill.shutdown()
    assert not prefill.held and prefill.allocator.num_free == prefill.allocator.num_pages


def fault_loop_leaves_nothing_behind(
    instances, pair, transfer: str, seed: int, kill_shape, single=None
) -> None:
    """The whole check of one data path: 200 seeded cases on the pair, both sides idle (pages after
    any quarantine expired), then a prefill rank killed mid-send on a prefill of kill_shape."""
    driver = Driver(*pair, heartbeat_timeout_s=2.0)
    try:
        first = None
        if single is not None:  # the single-rank engine's greedy first token
            one = SamplingParams(max_tokens=1)
            first = lambda ids: single.generate([ids], [one])[0][0]  # noqa: E731
        run_mixed_faults(driver, cases=200, seed=seed, quarantine=transfer == "nixl", first_token=first)
        server = driver.server  # no room left open on either side, no tombstone, no reservation kept
        _wait(lambda: not (server.reservations or server.peers or server.aborted), "side channel", driver)
        assert not driver.rooms.rooms and not driver.prefill_rooms.rooms and not driver.prefill_rooms.dropped
        assert all(not c.open and not c.outcomes for c in driver.rooms.clients.values())
    finally:
        driver.close()
    assert_idle(*pair)
    rank_killed_case(instances, pair[1], transfer, kill_shape)
