"""A fake KV source / destination pair (transfer/interfaces.py) for fast unit tests of the production
hand-off machines (transfer/prefill_room.py, transfer/decode_room.py): no ranks, no data path -- a
send adds its rows straight into the destination's room, if the ticket is the room's."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from pdserve.transfer.frames import new_ticket
from pdserve.transfer.messages import DecodeReservation, Fingerprint
from pdserve.transfer.plan import PrefillSide, plan_transfer
from pdserve.transfer.rank_commands import RoomStatus

FP = Fingerprint("hash", "auto", "float64", 4, 2, 1, "copy")


@dataclass
class FakeDestination:
    fp: Fingerprint = FP
    rooms: dict = field(default_factory=dict)  # room -> {"ticket", "expected", "rows"}
    pages: dict = field(default_factory=dict)  # room -> pages, from submit to release/commit
    committed: dict = field(default_factory=dict)
    released: dict = field(default_factory=dict)  # room -> hold_s

    def submit(self, room, prompt_len, params, prompt_ids=None):
        self.pages[room] = list(range(prompt_len // 4 + 1))

    def admitted_pages(self, room):
        return self.pages.get(room)

    def reserve(self, room, pages, prompt_len):
        ticket = new_ticket()
        self.rooms[room] = {"ticket": ticket, "expected": prompt_len * 2, "rows": 0}  # 2 layers of kv
        return DecodeReservation(room, self.fp, 0, 1, 1, 4, tuple(pages), {0: "fake://0"}, ticket)

    def handoff_bytes(self, pages, prompt_len, room=None):
        return prompt_len

    def fingerprint(self):
        return self.fp

    def room_status(self, room):
        r = self.rooms.get(room)
        return [
            RoomStatus(True, r["rows"], r["expected"], r["rows"] == r["expected"], checksum=r["rows"])
            if r
            else RoomStatus(False)
        ]

    def forget(self, room, quiesced):
        self.rooms.pop(room, None)
        return 0.0 if quiesced else 1.5

    def commit(self, room, first_token, more_first=()):
        self.pages.pop(room)
        self.committed[room] = first_token
        return SimpleNamespace(state="running", finish_reason=None)

    def release(self, room, hold_s):
        self.pages.pop(room, None)
        self.released[room] = hold_s

    def listener_problem(self):
        return None

    def write(self, room, ticket, rows):
        r = self.rooms.get(room)
        if r is not None and r["ticket"] == ticket:
            r["rows"] += rows


@dataclass
class FakeSource:
    dest: FakeDestination
    fp: Fingerprint = FP
    send_rows: bool = True
    held: set = field(default_factory=set)
    stream_handoff: bool = False  # prefill, then send (prefill_send: both, as one call)

    def handoff_fingerprint(self, reservation):
        return self.fp

    def prefill(self, request_id, token_ids, params=None):
        self.held.add(request_id)
        return SimpleNamespace(
            token=7,
            slots=list(range(len(token_ids))),
            logprob=None,
            prompt_logprobs=None,
            more_first=[],
            cached_len=0,
        )

    def prefill_side(self, slots):
        return PrefillSide(1, "full", 2, (), slots)

    def send(self, request_id, room, ticket, plan, endpoints):
        rows = sum(t.rows for t in plan)
        if self.send_rows:
            self.dest.write(room, ticket, rows)
        return {0: rows}

    def prefill_send(self, room, token_ids, params, decode, start, ticket, endpoints):
        result = self.prefill(room, token_ids, params)
        plan = plan_transfer(self.prefill_side(result.slots), decode, len(token_ids), start)
        return result, self.send(room, room, ticket, plan, endpoints)

    def release(self, request_id):
        self.held.discard(request_id)
