"""Constrained decoding with llguidance: one grammar matcher per request, a token mask per step.

Why llguidance (not xgrammar or outlines-core): its wheel is one abi3 file with no dependencies
(xgrammar pulls transformers, triton and apache-tvm-ffi into the image), it computes a mask on the
CPU in tens of microseconds without precompiling the whole vocabulary per schema, it compiles JSON
schemas (strict and not), regular expressions and Lark grammars from one entry point, and vLLM
ships it as its `guidance` backend. The router compiles a request's response_format into an
llguidance grammar (`grammar_for`, torch-free: a grammar it cannot compile is a 400 naming the
problem); the instances build matchers for it against the checkpoint's tokenizer (`Grammars`).
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance

# JSON as json.dumps writes it: no free whitespace. llguidance's default allows any run of
# whitespace between tokens, and a sampled model can then spend its whole budget on it. A schema's
# "x-guidance" object overrides these (llguidance's JSON options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile; the message names the problem."""


def grammar_for(kind: str, spec) -> str:
    """An llguidance grammar from "json_schema" (a dict), "json_object", "regex" or "lark" (text)."""
    try:
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(spec)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r}")
    except ValueError as e:
        raise GrammarError(str(e)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error)
    return grammar


def grammar_error(grammar: str) -> str | None:
    """Why an llguidance grammar (as grammar_for returns it) is invalid, or None: every instance edge
    checks a grammar before a rank sees it."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar) or None
    except Exception as e:  # not even the grammar's JSON envelope
        return f"{type(e).__name__}: {e}"


class Grammars:
    """Matchers for one process, against the checkpoint's tokenizer (built on first use)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: list[int]):
        self.model_dir, self.vocab_size, self.eos_ids = Path(model_dir), vocab_size, list(eos_ids)
        self._tokenizer = None

    def matcher(self, grammar: str) -> "Matcher":
        if self._tokenizer is None:
            text = (self.model_dir / "tokenizer.json").read_text(encoding="utf-8")
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return Matcher(llguidance.LLMatcher(self._tokenizer, grammar, log_level=0), self.vocab_size)


class Matcher:
    """One request's grammar state: `allowed()` the tokens the grammar permits next, `consume(token)`."""

    def __init__(self, m, vocab_size: int):
        self._m, self.vocab_size = m, vocab_size
        self.consumed = 0  # tokens consumed (the prefill's first token is consumed on the decode side)
        self._check()

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"grammar: {self._m.get_error()}")

    def bitmask(self) -> bytes:
        """The tokens the grammar permits next, as llguidance packs them: little-endian 32-bit words,
        bit i of word j is token 32j + i (what a decode step carries to the sampling rank)."""
        mask = self._m.compute_bitmask()
        self._check()
        return mask

    def allowed(self):
        """[V] bool tensor (the router never calls this: torch is imported here, not at the top)."""
        import torch

        from .logits_process import bitmask_words, unpack_bitmask

        return unpack_bitmask(
            bitmask_words([self.bitmask()], self.vocab_size, torch.device("cpu")), self.vocab_size
        )[0]

    def consume(self, token: int) -> None:
        self._m.consume_token(token)
        self.consumed += 1
        self._check()

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()
