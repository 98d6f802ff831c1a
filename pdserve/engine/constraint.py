"""Constrained decoding with llguidance: one grammar matcher per request, a token mask per step.

Why llguidance (not xgrammar or outlines-core): its wheel is one abi3 file with no dependencies
(xgrammar pulls transformers, triton and apache-tvm-ffi into the image), it computes a mask on the
CPU in tens of microseconds without precompiling the whole vocabulary per schema, it compiles JSON
schemas (strict and not), regular expressions and Lark grammars from one entry point, and vLLM
ships it as its `guidance` backend. The router compiles a request's response_format into an
llguidance grammar (`grammar_for`, torch-free: a grammar it cannot compile is a 400 naming the
problem); the instances build matchers for it against the checkpoint's tokenizer (`Grammars`):
the decode server process keeps each request's matcher and sends the step's masks to rank 0, the
prefill server process computes the first token's mask and sends it with the prefill command (its
ranks compile nothing); both compile in the background and let only that request wait.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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


@functools.lru_cache(maxsize=16)
def grammar_error(grammar: str) -> str | None:
    """Why an llguidance grammar (as grammar_for returns it) is invalid, or None: every instance edge
    checks a grammar before a rank sees it (on a worker thread: seconds for a large one; the answers
    for the latest grammars are kept, as a request's choices and its retries repeat them)."""
    try:
        return llguidance.LLMatcher.validate_grammar(grammar) or None
    except Exception as e:  # not even the grammar's JSON envelope
        return f"{type(e).__name__}: {e}"


class Grammars:
    """Matchers for one process, against the checkpoint's tokenizer (built on first use).

    Compiling a large grammar takes seconds (a JSON schema of 12,000 properties: ~1 s on an idle
    core), so a compiled grammar is kept (an LRU of `cache_size`, keyed by the grammar's hash) and
    each request, and each of its n choices, gets a copy of it (llguidance `deep_copy`, ~0.1 ms).
    `prepare` compiles on a background thread: a serving loop asks `ready` and lets a request wait,
    not every other request; a compile past `compile_timeout_s` fails the requests that wait for it.
    llguidance's native errors (a pyo3 panic is a BaseException) become GrammarError: they fail the
    request whose grammar it is, never the process or another request."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        eos_ids: list[int],
        cache_size: int = 16,
        compile_timeout_s: float = 60.0,
    ):
        self.model_dir, self.vocab_size, self.eos_ids = Path(model_dir), vocab_size, list(eos_ids)
        self.cache_size, self.compile_timeout_s = cache_size, compile_timeout_s
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, object] = OrderedDict()  # hash -> pristine LLMatcher
        self._jobs: dict[str, tuple[Future, float]] = {}  # hash -> (background compile, its start)
        self._pool: ThreadPoolExecutor | None = None

    def matcher(self, grammar: str) -> "Matcher":
        """A fresh matcher of `grammar`: a copy of the compiled one, compiled here if it is not yet."""
        key = _key(grammar)
        with self._lock:
            pristine = self._cached(key)
        if pristine is None:
            job = self._jobs.get(key)
            pristine = job[0].result() if job is not None else self._compile(grammar)
            self._keep(key, pristine)
        return Matcher(_native(pristine.deep_copy), self.vocab_size)

    def prepare(self, grammar: str) -> None:
        """Starts compiling `grammar` on the background thread unless it is compiled or compiling."""
        key = _key(grammar)
        with self._lock:
            if key in self._compiled or key in self._jobs:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            self._jobs[key] = (self._pool.submit(self._compile, grammar), time.monotonic())

    def ready(self, grammar: str) -> bool:
        """Whether a matcher of `grammar` can be had without compiling; GrammarError if its compile
        failed or ran past compile_timeout_s (prepare() first: a grammar never prepared is ready,
        compiled by `matcher` on the caller's thread)."""
        key = _key(grammar)
        with self._lock:
            if key in self._compiled:
                return True
            job = self._jobs.get(key)
        if job is None:
            return True
        future, start = job
        if not future.done():
            if time.monotonic() - start > self.compile_timeout_s:
                raise GrammarError(f"grammar: compiling took more than {self.compile_timeout_s:g} s")
            return False
        with self._lock:
            self._jobs.pop(key, None)
        self._keep(key, future.result())  # raises the compile's GrammarError
        return True

    def _compile(self, grammar: str):
        if self._tokenizer is None:
            text = (self.model_dir / "tokenizer.json").read_text(encoding="utf-8")
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        m = _native(llguidance.LLMatcher, self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar: {m.get_error()}")
        return m

    def _cached(self, key: str):
        m = self._compiled.get(key)
        if m is not None:
            self._compiled.move_to_end(key)
        return m

    def _keep(self, key: str, pristine) -> None:
        with self._lock:
            self._compiled[key] = pristine
            self._compiled.move_to_end(key)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)


def _key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode()).hexdigest()


def _native(fn, *args, **kwargs):
    """fn(...) with llguidance's native failures (a pyo3 PanicException is a BaseException, not an
    Exception) as GrammarError; KeyboardInterrupt and SystemExit pass."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except GrammarError:
        raise
    except BaseException as e:
        raise GrammarError(f"grammar: {type(e).__name__}: {e}") from None


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
        mask = _native(self._m.compute_bitmask)
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
        _native(self._m.consume_token, token)
        self.consumed += 1
        self._check()

    def advance(self, generated: Sequence[int], output_ids: Sequence[int]) -> None:
        """Consumes the tokens of generated + output_ids not consumed yet: the output of the request
        a migrated one continues (SamplingParams.generated), then its own. GrammarError if the
        grammar refuses one (a continuation that cannot be advanced fails, never samples blind)."""
        g = len(generated)
        for token in generated[self.consumed :]:
            self.consume(token)
        for token in output_ids[max(0, self.consumed - g) :]:
            self.consume(token)

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()
