"""Token ids -> text for one request: incremental detokenization plus stop strings.

`TextStream.add(token)` returns the text that may go to the client now. Text that could still
turn out to be the beginning of a stop string is held back; once a stop string appears, the text
before it is released, the rest is dropped and `stopped` is set (the caller ends the request
with finish_reason "stop"). Tokens whose bytes end mid-character are held by the detokenizer.
"""

from __future__ import annotations

from ..model.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self._detok = tokenizer.detokenizer()
        self._stop = [s for s in (stop or []) if s]
        self._pending = ""  # detokenized, not yet released (a possible stop-string prefix)
        self.stopped = False
        self.token_ids: list[int] = []  # every token taken, up to and including the one that stopped

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        return self._release(self._pending + self._detok.add_token(token_id))

    def finish(self) -> str:
        """The held-back text at the end of the stream (nothing after a stop string)."""
        if self.stopped:
            return ""
        text = self._release(self._pending + self._detok.flush(), final=True)
        return text

    def _release(self, text: str, final: bool = False) -> str:
        hit = min(((text.find(s), s) for s in self._stop if s in text), default=None)
        if hit is not None:
            self.stopped, self._pending = True, ""
            return text[: hit[0]]
        keep = 0 if final else _held_suffix(text, self._stop)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _held_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
