"""engine/constraint.Grammars (issue 40 item 1): a grammar compiles once per process and each
request / choice gets a copy; compiling runs on a background thread that a serving loop polls with
`ready`, so a slow grammar makes only its own request wait; a compile past its time budget fails
that request; llguidance's native failures (a pyo3 panic is a BaseException) become GrammarError.
The router's caps: schema characters, the compiled grammar's size and n x that size, each a 400."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.engine.constraint import GrammarError, Grammars, _native, grammar_for
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.protocol import ApiError
from pdserve.router.structured import MAX_SPEC_CHARS, check_choices_grammar, response_grammar

SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def big_schema(props: int) -> dict:
    """The issue's attack shape: many string properties with patterns (slow to compile)."""
    p = {f"p{i}": {"type": "string", "pattern": "^[a-z]{3,8}[0-9]+$"} for i in range(props)}
    return {"type": "object", "properties": p, "required": list(p)[:10]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gc") / "m", "glm_moe_dsa", "tiny", seed=0)


@pytest.fixture()
def grammars(model_dir) -> Grammars:
    tok = Tokenizer.from_pretrained(model_dir)
    return Grammars(model_dir, tok.vocab_size, tok.eos_token_ids, cache_size=2)


@pytest.fixture()
def compiles(monkeypatch) -> list[str]:
    """The grammars Grammars compiles, in order."""
    seen, real = [], Grammars._compile

    def counting(self, grammar):
        seen.append(grammar)
        return real(self, grammar)

    monkeypatch.setattr(Grammars, "_compile", counting)
    return seen


def test_one_compile_for_many_choices_each_an_independent_copy(grammars, compiles):
    g = grammar_for("json_schema", SMALL)
    matchers = [grammars.matcher(g) for _ in range(128)]
    assert compiles == [g]
    first = matchers[0].bitmask()
    token = next(t for t in range(grammars.vocab_size) if first[t // 8] >> (t % 8) & 1)
    matchers[0].consume(token)
    assert matchers[0].consumed == 1 and matchers[1].consumed == 0
    assert matchers[1].bitmask() == first  # the copy did not move with the other
    assert grammars.matcher(g).bitmask() == first  # nor did the cached original


def test_the_cache_keeps_the_most_recent_grammars(grammars, compiles):
    a, b, c = (grammar_for("regex", r) for r in ("a+", "b+", "c+"))
    for g in (a, b, a, c):  # cache_size 2: c evicts b, the least recently used
        grammars.matcher(g)
    grammars.matcher(a)
    grammars.matcher(b)
    assert compiles == [a, b, c, b]


def test_a_slow_grammar_compiles_in_the_background(grammars):
    g = grammar_for("json_schema", big_schema(3000))
    start = time.monotonic()
    grammars.prepare(g)
    assert grammars.ready(g) is False  # compiling: the caller goes on
    small = grammar_for("json_schema", SMALL)
    grammars.prepare(small)  # queued behind the big one; a never-prepared grammar is ready
    assert time.monotonic() - start < 0.5, "prepare / ready waited for the compile"
    deadline = time.monotonic() + 120
    while not grammars.ready(g):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert grammars.matcher(g).bitmask()


def test_a_compile_past_its_budget_fails_its_requests(model_dir):
    tok = Tokenizer.from_pretrained(model_dir)
    grammars = Grammars(model_dir, tok.vocab_size, tok.eos_token_ids, compile_timeout_s=0.0)
    g = grammar_for("json_schema", big_schema(2000))
    grammars.prepare(g)
    time.sleep(0.01)
    with pytest.raises(GrammarError, match="compiling took more than"):
        grammars.ready(g)


def test_a_grammar_that_fails_to_compile_is_a_grammar_error(grammars):
    bad = '{"grammars": [{"lark_grammar": "start: NOPE"}]}'
    grammars.prepare(bad)
    deadline = time.monotonic() + 30
    with pytest.raises(GrammarError):
        while not grammars.ready(bad):
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_native_panic_is_a_grammar_error_not_a_dead_thread():
    class PanicException(BaseException):  # what pyo3 raises for a Rust panic
        pass

    def panics():
        raise PanicException("index out of bounds")

    with pytest.raises(GrammarError, match="PanicException: index out of bounds"):
        _native(panics)
    with pytest.raises(KeyboardInterrupt):
        _native(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_router_caps_schema_grammar_and_choices():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": big_schema(12000)}}
    with pytest.raises(ApiError) as e:
        asyncio.run(response_grammar(fmt))
    assert e.value.status == 400 and str(MAX_SPEC_CHARS) in e.value.message
    grammar = asyncio.run(
        response_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": big_schema(2000)}})
    )
    check_choices_grammar(grammar, 2)
    with pytest.raises(ApiError) as e:
        check_choices_grammar(grammar, 128)
    assert e.value.status == 400 and e.value.param == "n"
