"""Logprobs in OpenAI's two shapes, from the instances' (token id, Logprob) pairs.

The numbers are the log-softmax of the model's raw logits, before logit_bias, penalties, grammar,
temperature, top-k and top-p (vLLM's and SGLang's default): the decode ranks compute them for the
tokens they sample, the prefill for the first token (it travels in the hand-off's TransferDone) and,
for `echo`, for every prompt token. Token strings are each token decoded on its own.

completions: {"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} | None],
              "text_offset": [int]}; with echo the prompt's tokens come first, the first with None.
chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
"""

from __future__ import annotations

from ..contracts import Logprob
from ..model.tokenizer import Tokenizer


class LogprobFormatter:
    """One choice's logprobs; `text_offset` continues across the chunks of a stream."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tok, self.chat, self.offset = tokenizer, chat, 0

    def _text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def format(self, ids: list[int], logprobs: list[Logprob | None]) -> dict:
        """The choice's "logprobs" for these tokens (one entry each, in order)."""
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(ids, logprobs)]}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp in zip(ids, logprobs):
            text = self._text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else self._top_map(lp))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _top_map(self, lp: Logprob) -> dict[str, float]:
        """{text: logprob}; two tokens with the same text (bytes of one character) keep the likelier."""
        top: dict[str, float] = {}
        for i, v in lp.top:
            top.setdefault(self._text(i), v)
        return top

    def _chat_entry(self, token_id: int, lp: Logprob) -> dict:
        text = self._text(token_id)
        top = [{"token": (s := self._text(i)), "logprob": v, "bytes": list(s.encode())} for i, v in lp.top]
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top}


def merge(into: dict | None, more: dict) -> dict:
    """Two consecutive pieces' logprobs as one (a non-streamed choice): `more`'s lists extend
    `into`'s in place (linear in the answer, however many pieces it came in)."""
    if into is None:
        return more
    for key, values in more.items():
        into[key].extend(values)
    return into
