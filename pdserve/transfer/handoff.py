"""One request's whole KV hand-off, prefill instance -> decode engine, driven from one process.

    decode   submit_remote + admit: pages reserved -> DecodeReservation (fingerprint, pages, endpoints, ticket)
    prefill  fingerprint checked -> prefill the prompt (pages held) -> plan_transfer(PrefillSide, DecodeSide)
    decode   every rank expects its rows of the plan (ExpectCmd) -- BEFORE anything is sent, since a
             receiver drops frames of rooms it does not expect
    prefill  every rank PUSHes its share (SendCmd) -> TransferDone (first token, per-rank checksums, layout echo)
    decode   polls TransferStatusCmd until every expected row arrived (or the transfer timeout),
             checks errors, checksums and the layout echo -> kv_ready: the request runs.
On any failure both sides release what they hold (prefill pages, decode pages and receiver room
state) and `TransferError` names the reason; the instances stay usable (docs/design.md 3.7-3.8). The
decode side is told the room is quiesced (a NIXL receive region is reusable at once) unless the
prefill ranks may still be sending: only when prefill.send itself broke off (not a SendError).
The same code runs over either data path (the ranks' `transfer`: tcp or nixl).
The prefill's pages are released on success too: the decode instance now owns the only copy.
What crosses between the two sides are the side-channel messages (transfer/messages.py), so a
ZMQ side channel between the two main processes can replace the direct calls without changing them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from ..decode_server.engine import DecodeEngine
from ..decode_server.scheduler import DecodeRequest
from ..engine.request import SamplingParams
from ..prefill_server.instance import PrefillInstance
from .base import KVPoll, TransferState
from .messages import DecodeReservation, Fingerprint, TransferDone, TransferFailed, model_hash
from .plan import plan_transfer
from .tcp import SendError

_rooms = itertools.count()


class TransferError(RuntimeError):
    """A hand-off failed; both sides released the request. `failed` is the TransferFailed message."""

    def __init__(self, failed: TransferFailed):
        super().__init__(f"room {failed.room}: {failed.reason}")
        self.failed = failed


@dataclasses.dataclass
class HandoffHooks:
    """Test hooks for fault injection."""

    corrupt: bool = False  # flip one payload byte after the sender checksummed it
    skip_send: bool = False  # the data never comes (transfer timeout)
    after_send: object = None  # callable(room) run after the senders returned, before polling


def prefill_fingerprint(prefill: PrefillInstance, reservation: DecodeReservation) -> Fingerprint:
    """What the prefill side asserts: its model, dtype and layer count; the layout fields it
    will pack for are the reservation's (the prefill packs for any layout)."""
    fp = reservation.fingerprint
    return dataclasses.replace(
        fp,
        model_hash=model_hash(prefill.worker.model_dir),
        model_dtype=prefill.worker.dtype,
        num_layers=prefill.model_config.num_layers,
    )


def hand_off(
    prefill: PrefillInstance,
    decode: DecodeEngine,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    room: str | None = None,
    timeout_s: float = 30.0,
    hooks: HandoffHooks | None = None,
) -> DecodeRequest:
    """Prefills `prompt_ids` on `prefill` and delivers the cache to `decode`; returns the decode
    request, now running (or already finished when its first token ends it)."""
    room = room or f"room-{next(_rooms)}"
    hooks = hooks or HandoffHooks()
    state = TransferState(room)
    req = decode.submit_remote(len(prompt_ids), params, request_id=room)
    try:
        decode.admit()
        if req.state != "waiting_for_kv":
            raise HandoffFailure("the decode instance has no free pages for this request now")
        reservation = decode.instance.reservation(room, req.pages, prompt_len=len(prompt_ids))
        prefill_fingerprint(prefill, reservation).check_compatible(reservation.fingerprint)
        state.advance(KVPoll.WaitingForInput)
        done = _transfer(prefill, decode, prompt_ids, params, reservation, state, hooks, timeout_s)
        verify_done(decode, reservation, done)
        state.advance(KVPoll.Success)
    except Exception as e:
        reason = e.reason if isinstance(e, HandoffFailure) else f"{type(e).__name__}: {e}"
        state.fail(reason)
        _release(prefill, decode, room, quiesced=not isinstance(e, HandoffFailure) or e.quiesced)
        raise TransferError(TransferFailed(room, reason)) from e
    _release(prefill, decode, room, abort_decode=False)
    return decode.kv_ready(room, done.first_token)


class HandoffFailure(Exception):
    """Internal: a reason to fail the room (becomes TransferFailed / TransferError)."""

    def __init__(self, reason: str, quiesced: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.quiesced = quiesced  # False: prefill ranks may still be writing for the room


def _transfer(prefill, decode, prompt_ids, params, reservation, state, hooks, timeout_s) -> TransferDone:
    room = reservation.room
    result = prefill.prefill(room, list(prompt_ids), params or SamplingParams())
    plan = plan_transfer(
        prefill.prefill_side(result.slots),
        decode.instance.decode_side(list(reservation.pages)),
        len(prompt_ids),
    )
    decode.instance.expect(room, reservation.ticket, plan, list(reservation.pages))
    state.advance(KVPoll.Transferring)
    checksums = {}
    if not hooks.skip_send:
        try:
            checksums = prefill.send(
                room, room, reservation.ticket, plan, reservation.endpoints, corrupt=hooks.corrupt
            )
        except SendError:
            raise  # every rank returned: what it posted is done or cancelled
        except Exception as e:
            raise HandoffFailure(f"{type(e).__name__}: {e}", quiesced=False) from e
    if hooks.after_send:
        hooks.after_send(room)
    done = TransferDone(room, result.token, checksums, prefill_fingerprint(prefill, reservation))
    _wait_for_rows(decode, room, timeout_s)
    return done


def _wait_for_rows(decode: DecodeEngine, room: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = decode.instance.transfer_status(room)
        errors = [f"decode rank {r}: {s['error']}" for r, s in enumerate(status) if s.get("error")]
        if errors:
            raise HandoffFailure("; ".join(errors))
        if not all(s["known"] for s in status):
            raise HandoffFailure("the decode side dropped the room (aborted)")
        if all(s["complete"] for s in status):
            return
        if time.monotonic() > deadline:
            got = [f"rank {r}: {s.get('rows')}/{s.get('expected')}" for r, s in enumerate(status)]
            raise HandoffFailure(f"transfer timeout after {timeout_s} s: rows received {', '.join(got)}")
        time.sleep(0.005)  # frames are in flight; status calls are cheap pipe round trips


def verify_done(decode: DecodeEngine, reservation: DecodeReservation, done: TransferDone) -> None:
    """The aux data: room echo, layout echo against the decode side's CURRENT fingerprint, checksums."""
    if done.room != reservation.room:
        raise HandoffFailure(f"aux data for room {done.room}, expected {reservation.room}")
    try:
        decode.instance.fingerprint().check_compatible(done.fingerprint)
    except Exception as e:
        raise HandoffFailure(f"aux data: {e}") from None
    status = decode.instance.transfer_status(reservation.room)
    for rank, s in enumerate(status):
        if s["checksum"] != done.checksums.get(rank, 0):
            raise HandoffFailure(
                f"checksum mismatch on decode rank {rank}: received {s['checksum']:#010x}, "
                f"sender sent {done.checksums.get(rank, 0):#010x}"
            )


def _release(
    prefill: PrefillInstance,
    decode: DecodeEngine,
    room: str,
    abort_decode: bool = True,
    quiesced: bool = True,
) -> None:
    """Both sides drop the room; on failure the decode request is aborted (its pages freed, or held
    while senders may still write into them)."""
    hold_s = 0.0
    try:
        hold_s = decode.instance.forget(room, quiesced)
    except Exception:
        pass  # a broken rank group is reported by its own watchdog; keep releasing the rest
    try:
        prefill.release(room)
    except Exception:
        pass
    if abort_decode:
        decode.abort(room, hold_s)
