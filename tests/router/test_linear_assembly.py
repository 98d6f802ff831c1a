"""The router's answer assembly is linear in the output (issue 40 item 3): logprob merging, stop
strings held back, an open tool-call block growing to 80 KB and its parse take under 100 ms at 40k
tokens each (they took seconds to minutes, quadratic), and twice the tokens take less than three
times as long. The incremental matchers find exactly what the code they replace found."""

from __future__ import annotations

import random
import re
import time

import httpx

from pdserve.router.logprobs import merge
from pdserve.router.stop_match import StopMatcher, automaton
from pdserve.router.tool_parsers import (
    ChatParser,
    DeepSeekV32Markup,
    Glm5Markup,
    _dsml_invokes,
    _dsml_params,
    _glm_args,
)
from tests.reference import free_port
from tests.router.helpers import router_config, running_router

N = 40_000
BUDGET_S = 0.100  # the three paths together, at N tokens each
GIVE_UP_S = 2.0  # a quadratic path stops here (the test fails) instead of running for minutes
# the worst case of the held-back suffix: long stop strings, one always half matched
STOPS = ["b" * 1023 + "c"] * 15 + ["a" * 1023 + "b"]


class TooSlow(Exception):
    pass


def _check(start: float, i: int) -> None:
    if i % 1000 == 0 and time.perf_counter() - start > GIVE_UP_S:
        raise TooSlow


def logprobs_path(n: int) -> float:
    pieces = [
        {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]} for _ in range(n)
    ]
    start, cpu = time.perf_counter(), time.process_time()
    merged = None
    for i, piece in enumerate(pieces):  # what respond.collect does per piece of a non-streamed choice
        merged = merge(merged, piece)
        _check(start, i)
    took = time.process_time() - cpu
    assert len(merged["content"]) == n
    return took


def stop_path(n: int) -> float:
    automaton.cache_clear()  # the automaton's build counts too
    start, cpu = time.perf_counter(), time.process_time()
    m, out = StopMatcher(STOPS), []
    for i in range(n):
        text, stopped = m.feed("a")
        out.append(text)
        assert not stopped
        _check(start, i)
    took = time.process_time() - cpu
    assert len("".join(out)) == n - 1023  # the last 1,023 characters may still begin a stop string
    return took


def tool_path(n: int) -> float:
    unit = "<arg_key>x</arg_key> "  # no <arg_value>: the lazy regex scanned to the end from each key
    block = (unit * (2 * n // len(unit) + 1))[: 2 * n]  # 80 KB at 40k pieces of 2 characters
    pieces = [block[i : i + 2] for i in range(0, len(block), 2)]
    start, cpu = time.perf_counter(), time.process_time()
    p, out = ChatParser(Glm5Markup(), in_reasoning=False), []
    out += p.feed("<tool_call>f")
    for i, piece in enumerate(pieces):
        out += p.feed(piece)
        _check(start, i)
    out += p.feed("</tool_call>")
    took = time.process_time() - cpu
    (call,) = [d["tool_call"] for d in out if "tool_call" in d]
    assert call.name == "f" and call.arguments == "{}"
    return took


PATHS = (logprobs_path, stop_path, tool_path)


def _best(path, n: int, repeats: int = 3) -> float:
    try:
        return min(path(n) for _ in range(repeats))
    except TooSlow:
        return float("inf")


def test_three_paths_at_40k_tokens_take_under_100_ms_and_scale_linearly():
    times = {path.__name__: _best(path, N) for path in PATHS}  # CPU seconds: robust to a busy machine
    assert sum(times.values()) < BUDGET_S, times
    for path in PATHS:  # 2x the tokens: < 3x the time (linear, with room for a noisy machine)
        small, big = _best(path, N // 2), _best(path, N)
        assert big < 3 * small + 0.002, (path.__name__, small, big)


# ----------------------------------------------------------------------------------- exactness


def _reference_stop(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    """The replaced TextStream._release: find every stop string in the held text + the new piece,
    hold back the longest end that begins one."""
    out, pending = [], ""
    for piece in pieces:
        text = pending + piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            out.append(text[: min(hits)])
            return out, True
        keep = max(
            (n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
            default=0,
        )
        out.append(text[: len(text) - keep])
        pending = text[len(text) - keep :]
    out.append(pending)
    return out, False


def test_stop_matcher_equals_the_replaced_search():
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))
        ]
        text = "".join(rng.choice(alphabet + "x") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if text else []
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        m, got, stopped = StopMatcher(stops), [], False
        for piece in pieces:
            released, stopped = m.feed(piece)
            got.append(released)
            if stopped:
                break
        if not stopped:
            got.append(m.flush())
        want, want_stopped = _reference_stop(pieces, stops)
        assert (got, stopped) == (want, want_stopped), (stops, pieces)


_GLM = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>', re.S)
_PARAM = re.compile(
    r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.S
)


def test_marker_splitting_equals_the_replaced_regexes():
    rng = random.Random(1)
    glm = ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", " ", "\n", "k", "v", "<", ">"]
    dsml = [
        '<｜DSML｜invoke name="',
        "</｜DSML｜invoke>",
        '<｜DSML｜parameter name="',
        '" string="',
        "true",
        "false",
        '">',
        "</｜DSML｜parameter>",
        '"',
        "n",
        "\n",
    ]
    for _ in range(5000):
        block = "".join(rng.choice(glm) for _ in range(rng.randint(0, 14)))
        assert _glm_args(block) == _GLM.findall(block), block
        block = "".join(rng.choice(dsml) for _ in range(rng.randint(0, 14)))
        assert _dsml_invokes(block) == _INVOKE.findall(block), block
        assert _dsml_params(block) == _PARAM.findall(block), block


def test_tool_call_split_anywhere_parses_alike():
    """The end marker is found whatever the chunking, also split over several pieces."""
    for markup, text in (
        (Glm5Markup(), "hi <tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call> bye"),
        (
            DeepSeekV32Markup(),
            'hi <｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" '
            'string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls> bye',
        ),
    ):
        for size in (1, 2, 3, 7, len(text)):
            p, out = ChatParser(markup, in_reasoning=False), []
            for i in range(0, len(text), size):
                out += p.feed(text[i : i + size])
            out += p.finish()
            content = "".join(d.get("content", "") for d in out)
            calls = [(d["tool_call"].name, d["tool_call"].arguments) for d in out if "tool_call" in d]
            assert content == "hi  bye" and calls == [("f", '{"a": 1}')], (size, out)


def test_a_large_answer_is_served_only_streamed(model_dir):
    """n x max_tokens x (1 + top_logprobs) beyond --max-response-budget: 400 unless stream = true
    (no instance is up: an accepted request gets 503, after the budget check)."""
    down = f"http://127.0.0.1:{free_port()}"
    cfg = router_config(model_dir, down, f"http://127.0.0.1:{free_port()}", max_response_budget=999)
    with running_router(cfg) as (url, _):
        body = {
            "model": "tiny",
            "prompt": "hi",
            "n": 2,
            "max_tokens": 100,
            "logprobs": 4,
        }  # 2 x 100 x 5 = 1000
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "response_too_large", r.text
        assert "--max-response-budget" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
        assert r.status_code == 503, r.text
        r = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 3}, timeout=30)  # 2 x 100 x 4 = 800
        assert r.status_code == 503, r.text
