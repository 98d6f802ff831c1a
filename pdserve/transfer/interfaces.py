"""What the servers implement for the hand-off state machines (transfer/prefill_room.py,
transfer/decode_room.py): a prefill-side KV source and a decode-side KV destination.

transfer/ is a leaf under the servers (docs/design.md section 2): the machines see an instance only
through these protocols, so the prefill instance (prefill_server/instance.py) and the decode
engine (decode_server/destination.py) implement them, and tests may hand the machines a wrapper
that injects a fault at one call.
"""

from __future__ import annotations

from typing import Protocol

from ..request import SamplingParams
from .messages import DecodeReservation, Fingerprint
from .plan import DecodeSide, PrefillSide, Transfer
from .rank_commands import RoomStatus


class Prefilled(Protocol):
    token: int  # the first token, sampled by the prefill
    slots: list[int]  # where the prompt's rows sit in the source's pool
    logprob: object  # the first token's TokenLogprob (request.py) when asked for, else None
    prompt_logprobs: list | None  # [TokenLogprob | None] per prompt position when asked for (echo)
    more_first: list  # n > 1: [(token, TokenLogprob | None)] of choices 1..n-1
    cached_len: int  # leading prompt positions the source's prefix cache served (not computed)


class KVSource(Protocol):
    """A prefill instance: computes a room's rows, sends them, releases them -- one after the other
    (prefill, send), or the rows sent while they are computed (stream_handoff: prefill_send)."""

    stream_handoff: bool  # PrefillRoom.run calls prefill_send, else prefill then send

    def handoff_fingerprint(self, reservation: DecodeReservation) -> Fingerprint:
        """What this side asserts against the reservation's fingerprint (model, dtype, layers)."""
        ...

    def prefill(
        self, request_id: str, token_ids: list[int], params: SamplingParams | None = None
    ) -> Prefilled:
        """Computes the prompt's rows (request_id: the room); they stay held until release(request_id)."""
        ...

    def prefill_side(self, slots: list[int]) -> PrefillSide: ...

    def prefill_send(
        self,
        room: str,
        token_ids: list[int],
        params: SamplingParams | None,
        decode: DecodeSide,
        start: int,
        ticket: bytes,
        endpoints: dict[int, str],
    ) -> tuple[Prefilled, dict[int, int]]:
        """Computes the prompt's rows while every rank sends its share of positions [start, n) as
        they are stored; (the prefilled result, the checksum per decode rank) once every rank's
        sends completed or were cancelled (SendError when a destination took nothing). The rows
        stay held until release(room)."""
        ...

    def send(
        self, request_id: str, room: str, ticket: bytes, plan: list[Transfer], endpoints: dict[int, str]
    ) -> dict[int, int]:
        """Every rank sends its share of plan; returns the checksum per decode rank (SendError when a
        destination took nothing). Returns only after every rank's sends completed or were cancelled."""
        ...

    def release(self, request_id: str) -> None:
        """Frees the room's rows (no-op when none are held)."""
        ...


class Admitted(Protocol):
    state: str  # "running" or "finished" after kv_ready
    finish_reason: str | None


class KVDestination(Protocol):
    """A decode instance: reserves rows for a room, says where they land and how many arrived,
    then starts the request (commit) or releases everything."""

    def submit(
        self, room: str, prompt_len: int, params: SamplingParams, prompt_ids: list[int] | None = None
    ) -> None:
        """Queues the room for pages; ValueError when it can never fit (nothing is kept). prompt_ids:
        a prefix cache may hold its leading pages (the reservation then says how many tokens)."""
        ...

    def admitted_pages(self, room: str) -> list[int] | None:
        """The room's reserved pages once admitted, else None (still queued)."""
        ...

    def reserve(self, room: str, pages: list[int], prompt_len: int) -> DecodeReservation:
        """A new ticket; every rank staged for the room and expecting its row total, in one round
        trip, before anything can be sent. RuntimeError (nothing left staged) when a rank cannot."""
        ...

    def handoff_bytes(self, pages: list[int], prompt_len: int, room: str | None = None) -> int:
        """Payload the room's hand-off carries (without the rows the room's prefix cache holds)."""
        ...

    def fingerprint(self) -> Fingerprint: ...

    def room_status(self, room: str) -> list[RoomStatus]:
        """Every rank's rows received / expected, checksum and error for the room."""
        ...

    def forget(self, room: str, quiesced: bool) -> float:
        """Every rank drops the room; returns how long its pages must stay unused (quarantine)."""
        ...

    def commit(self, room: str, first_token: int, more_first: list = ()) -> Admitted:
        """The rows arrived and were verified: the request joins the running batch. more_first:
        TransferDone.more_first, the other choices' first tokens (n > 1)."""
        ...

    def release(self, room: str, hold_s: float) -> None:
        """The request ends without running; its pages are freed (held hold_s first)."""
        ...

    def listener_problem(self) -> str | None:
        """Why a rank's data-path receiver cannot receive, or None."""
        ...
