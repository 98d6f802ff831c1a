"""Token ids -> text for one request: incremental detokenization plus stop strings.

`TextStream.add(token)` returns the text that may go to the client now. Text that could still
turn out to be the beginning of a stop string is held back; once a stop string appears, the text
before it is released, the rest is dropped and `stopped` is set (the caller ends the request
with finish_reason "stop"). Tokens whose bytes end mid-character are held by the detokenizer.
The stop strings are matched incrementally (stop_match.py): O(1) per character.
"""

from __future__ import annotations

from ..model.tokenizer import Tokenizer
from .stop_match import StopMatcher


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self._detok = tokenizer.detokenizer()
        self._stop = StopMatcher(stop or ())
        self.stopped = False
        self.token_ids: list[int] = []  # every token taken, up to and including the one that stopped

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        text, self.stopped = self._stop.feed(self._detok.add_token(token_id))
        return text

    def finish(self) -> str:
        """The held-back text at the end of the stream (nothing after a stop string)."""
        if self.stopped:
            return ""
        text, self.stopped = self._stop.feed(self._detok.flush())
        return text + self._stop.flush()
