"""`DriverDestination`: the decode step driver as the KV destination of hand-offs (transfer/interfaces.py).

The decode room machines (transfer/decode_room.py) reserve, inspect, commit and release through it;
every call runs on the decode loop thread (loop.py), which owns the DecodeStepDriver.
"""

from __future__ import annotations

from ..request import SamplingParams, TokenLogprob
from ..transfer.messages import DecodeReservation, Fingerprint
from ..transfer.rank_commands import RoomStatus
from .scheduler import DecodeRequest
from .step_driver import DecodeStepDriver


class DriverDestination:
    def __init__(self, driver: DecodeStepDriver):
        self.driver, self.instance = driver, driver.instance

    def submit(
        self, room: str, prompt_len: int, params: SamplingParams, prompt_ids: list[int] | None = None
    ) -> None:
        self.driver.submit_remote(prompt_len, params, request_id=room, prompt_ids=prompt_ids)

    def admitted_pages(self, room: str) -> list[int] | None:
        req = self.driver.scheduler.waiting_for_kv.get(room)
        return None if req is None else req.pages

    def reserve(self, room: str, pages: list[int], prompt_len: int) -> DecodeReservation:
        """The reservation names the prompt's leading tokens this instance holds (its prefix cache):
        the prefill sends only the rest."""
        cached = self._cached_len(room)
        reservation = self.instance.reservation(
            room, pages, prompt_len=prompt_len, expect=True, cached_len=cached
        )
        if cached:  # what a hand-off of the cached positions alone would have carried
            ps = self.instance.allocator.page_size
            self.instance.handoff_skipped_bytes += self.instance.handoff_bytes(pages[: cached // ps], cached)
        return reservation

    def handoff_bytes(self, pages: list[int], prompt_len: int, room: str | None = None) -> int:
        return self.instance.handoff_bytes(pages, prompt_len, self._cached_len(room))

    def _cached_len(self, room: str | None) -> int:
        req = self.driver.scheduler.waiting_for_kv.get(room) if room is not None else None
        return req.cached_len if req is not None else 0

    def fingerprint(self) -> Fingerprint:
        return self.instance.fingerprint()

    def room_status(self, room: str) -> list[RoomStatus]:
        return self.instance.room_status(room)

    def forget(self, room: str, quiesced: bool) -> float:
        return self.instance.forget(room, quiesced)

    def commit(self, room: str, first_token: int, more_first: list = ()) -> DecodeRequest:
        """more_first: [[token, logprobs wire], ...] of choices 1..n-1 (TransferDone.more_first)."""
        more = [(token, TokenLogprob.from_wire(lp)) for token, lp in more_first]
        return self.driver.kv_ready(room, first_token, more_first=more)

    def release(self, room: str, hold_s: float) -> None:
        self.driver.abort(room, hold_s)

    def listener_problem(self) -> str | None:
        return self.instance.listener_problem()
