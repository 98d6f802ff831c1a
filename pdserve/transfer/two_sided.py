"""The hand-off as the two main processes run it, talking only over the side channel.

    decode   decode_reserve: pages reserved, every rank expects its row TOTAL (decode knows it
             alone), DecodeReservation sent to the prefill's bootstrap ROUTER
    prefill  prefill_serve: waits for the reservation (bootstrap timeout), checks the fingerprint,
             prefills, plans, every rank sends its share, replies TransferDone (or TransferFailed)
             LAST, and releases its pages in every case (the frames were copied out when sent)
    decode   decode_finish: waits for the outcome AND every expected row (transfer timeout),
             verifies checksums and the layout echo -> kv_ready; on any failure it releases and
             tells the prefill (TransferFailed), so a prefill still waiting stops too.
Each function is called by its own side; tests call all three in one process, in order.
"""

from __future__ import annotations

import time

from ..decode_server.engine import DecodeEngine
from ..decode_server.scheduler import DecodeRequest
from ..engine.request import SamplingParams
from ..prefill_server.instance import PrefillInstance
from .handoff import HandoffFailure, HandoffHooks, TransferError, prefill_fingerprint, verify_done
from .messages import DecodeReservation, TransferDone, TransferFailed
from .plan import DecodeSide, plan_transfer
from .side_channel import BootstrapServer, BootstrapTimeout, DecodeClient


def decode_reserve(
    engine: DecodeEngine,
    client: DecodeClient,
    room: str,
    prompt_len: int,
    params: SamplingParams | None = None,
) -> tuple[DecodeRequest, DecodeReservation]:
    req = engine.submit_remote(prompt_len, params, request_id=room)
    engine.admit()
    if req.state != "waiting_for_kv":
        engine.abort(room)
        raise TransferError(
            TransferFailed(room, "the decode instance has no free pages for this request now")
        )
    try:
        reservation = engine.instance.reservation(room, req.pages, prompt_len=prompt_len)
    except RuntimeError as e:  # a rank could not stage the room (e.g. NIXL receive staging full)
        engine.abort(room)
        raise TransferError(TransferFailed(room, str(e))) from None
    engine.instance.expect_totals(room, reservation.ticket, req.pages, prompt_len)  # before anything is sent
    client.send(reservation)
    return req, reservation


def prefill_serve(
    prefill: PrefillInstance,
    server: BootstrapServer,
    room: str,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    bootstrap_timeout_s: float = 30.0,
    hooks: HandoffHooks | None = None,
) -> TransferDone | TransferFailed:
    """The prefill side of one room. Returns the outcome it sent to the decode side."""
    try:
        reservation = server.wait_reservation(room, bootstrap_timeout_s)
    except BootstrapTimeout as e:
        server.forget(room)
        return TransferFailed(room, str(e))  # no decode peer to tell
    return serve_reserved(prefill, server, reservation, prompt_ids, params, hooks)


def serve_reserved(
    prefill: PrefillInstance,
    server: BootstrapServer,
    reservation: DecodeReservation,
    prompt_ids: list[int],
    params: SamplingParams | None = None,
    hooks: HandoffHooks | None = None,
) -> TransferDone | TransferFailed:
    """A room whose reservation arrived: fingerprint, prefill, send, outcome LAST; pages released."""
    hooks, room = hooks or HandoffHooks(), reservation.room
    server.claim(room)  # the reservation stays until reply() forgets it (no expiry mid-hand-off)
    try:
        fp = prefill_fingerprint(prefill, reservation)
        fp.check_compatible(reservation.fingerprint)
        result = prefill.prefill(room, list(prompt_ids), params or SamplingParams())
        server.drain()
        if room in server.aborted:
            raise HandoffFailure(f"aborted by decode: {server.aborted[room]}")
        decode_side = DecodeSide(
            reservation.tp_size, reservation.dcp_size, fp.index_mode, reservation.page_size, reservation.pages
        )
        plan = plan_transfer(prefill.prefill_side(result.slots), decode_side, len(prompt_ids))
        sums = (
            {}
            if hooks.skip_send
            else prefill.send(
                room, room, reservation.ticket, plan, reservation.endpoints, corrupt=hooks.corrupt
            )
        )
        msg: TransferDone | TransferFailed = TransferDone(room, result.token, sums, fp)
    except Exception as e:
        msg = TransferFailed(room, e.reason if isinstance(e, HandoffFailure) else f"{type(e).__name__}: {e}")
    finally:
        prefill.release(room)
    server.reply(msg)
    return msg


def decode_finish(
    engine: DecodeEngine, client: DecodeClient, reservation: DecodeReservation, timeout_s: float = 30.0
) -> DecodeRequest:
    """Waits for the prefill's outcome and every row; the request runs, or everything is released."""
    room = reservation.room
    try:
        done = _wait(engine, client, room, timeout_s)
        verify_done(engine, reservation, done)
    except HandoffFailure as e:
        client.send(TransferFailed(room, e.reason))  # a prefill still working on the room stops
        _release(engine, client, room, quiesced=client.outcome(room) is not None)
        raise TransferError(TransferFailed(room, e.reason)) from None
    _release(engine, client, room, abort=False)
    return engine.kv_ready(room, done.first_token)


def _wait(engine: DecodeEngine, client: DecodeClient, room: str, timeout_s: float) -> TransferDone:
    deadline = time.monotonic() + timeout_s
    while (done := poll_room(engine, client, room, deadline, timeout_s)) is None:
        client.drain(5)  # waits up to 5 ms for the outcome; rows are counted by the rank threads
    return done


def poll_room(
    engine: DecodeEngine, client: DecodeClient, room: str, deadline: float, timeout_s: float
) -> TransferDone | None:
    """One non-blocking look at a room: its TransferDone once the outcome AND every row are in,
    None while in flight; HandoffFailure for a failed prefill, a rank's error or the deadline.
    The ranks are asked only once the outcome came (or at the deadline): the prefill answers
    after its last frame, so earlier questions could not finish the room anyway."""
    outcome = client.outcome(room)
    if isinstance(outcome, TransferFailed):
        raise HandoffFailure(f"prefill failed: {outcome.reason}")
    late = time.monotonic() > deadline
    if outcome is None and not late:
        return None
    status = engine.instance.transfer_status(room)
    errors = [f"decode rank {r}: {s['error']}" for r, s in enumerate(status) if s.get("error")]
    if errors:
        raise HandoffFailure("; ".join(errors))
    if outcome is not None and all(s["known"] and s["complete"] for s in status):
        return outcome
    if late:
        got = ", ".join(f"rank {r}: {s.get('rows')}/{s.get('expected')}" for r, s in enumerate(status))
        waited = "the prefill's outcome" if outcome is None else "the rows"
        raise HandoffFailure(f"transfer timeout after {timeout_s} s waiting for {waited} (rows {got})")
    return None


def _release(
    engine: DecodeEngine, client: DecodeClient, room: str, abort: bool = True, quiesced: bool = True
) -> None:
    """quiesced: the prefill answered, so it sent everything it will (it answers after its ranks returned)."""
    hold_s = engine.instance.forget(room, quiesced)
    client.forget(room)
    if abort:
        engine.abort(room, hold_s)
