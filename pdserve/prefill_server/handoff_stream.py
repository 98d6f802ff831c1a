"""A prefill rank's side of a streamed hand-off: its rows leave while the prompt is computed.

The prefill rank command carries a `StreamedSend` (transfer/rank_commands.py): the whole plan cut
into segments of prompt positions (transfer/plan.py plan_stream), one per chunk plus one for the
positions the prefix cache already held. The rank opens the send before its first chunk and
  - posts every segment whose rows exist already (`ready`: the cached positions) at once;
  - during a chunk, posts the chunk's segment layer by layer, as CPBackend stores each layer's
    entries (`layer`, its on_stored hook), so the rows of layer l travel while layers l+1.. compute;
  - after the chunk, posts what no layer hook posted (`chunk_done`: nothing, unless a layer was
    never stored here);
and closes the send after the last chunk, whatever happened: the reply (checksums or the error) is
SendCmd's, and every WRITE it posted is DONE or cancelled by then. A destination that fails stops
this rank's posting for the room, never its compute: the other ranks' collectives go on.
"""

from __future__ import annotations

from ..runtime.faults import check_layer_fault
from ..transfer.plan import Transfer
from ..transfer.rank_commands import SendReply, StreamedSend


class LayerStream:
    def __init__(self, sender, spec: StreamedSend, rank: int):
        self.sender, self.rank, self.room = sender, rank, spec.send.room
        plan = spec.send.plan
        # per segment, this rank's transfers by layer
        self.segments: list[tuple[int, dict[int, list[Transfer]]]] = []
        for seg in spec.segments:
            by_layer: dict[int, list[Transfer]] = {}
            for t in plan[seg.lo : seg.hi]:
                if t.src_rank == rank:
                    by_layer.setdefault(t.layer, []).append(t)
            self.segments.append((seg.end, by_layer))
        self.next = 0  # the first segment not yet posted whole
        self.current: list[dict[int, list[Transfer]]] = []  # the running chunk's segments
        self.error: str | None = None  # a post that raised: nothing more is posted
        sender.open(spec.send)

    def _post(self, transfers: list[Transfer]) -> None:
        """Posts, never raising: an exception here would stop this rank's compute mid-chunk while
        the other ranks wait for it in a collective."""
        if self.error is None and transfers:
            try:
                self.sender.post(transfers)
            except Exception as e:
                self.error = f"prefill rank {self.rank}: {type(e).__name__}: {e}"

    def ready(self, upto: int) -> None:
        """Posts every segment whose positions all lie before `upto` (their rows exist)."""
        while self.next < len(self.segments) and self.segments[self.next][0] <= upto:
            for transfers in self.segments[self.next][1].values():
                self._post(transfers)
            self.next += 1

    def chunk(self, end: int) -> None:
        """A chunk that computes positions up to `end` begins: its segments go out layer by layer."""
        first = self.next
        while self.next < len(self.segments) and self.segments[self.next][0] <= end:
            self.next += 1
        self.current = [by_layer for _, by_layer in self.segments[first : self.next]]

    def layer(self, layer: int) -> None:
        """The running chunk stored this layer's entries: their rows leave now."""
        for by_layer in self.current:
            self._post(by_layer.pop(layer, []))
        # test-only, off by default (runtime/faults.py): what was posted leaves before the kill
        check_layer_fault(self.room, layer, self.rank, self.sender.settle_posted)

    def chunk_done(self) -> None:
        for by_layer in self.current:
            for layer in sorted(by_layer):
                self._post(by_layer.pop(layer))
        self.current = []

    def close(self) -> SendReply:
        """Ends the send (every segment posted or not): SendCmd's reply."""
        reply = self.sender.close_send()
        return SendReply(error=self.error) if self.error else reply
