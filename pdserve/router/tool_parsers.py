"""The model's own markup in generated text -> reasoning, content and tool calls, by model type.

GLM-5 (`glm_moe_dsa`, the GLM-4.5 family's markup):
    <think>reasoning</think>content<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>
    (newlines between the parts are allowed; a string argument is written raw, any other as JSON)
DeepSeek-V3.2 (`deepseek_v32`, DSML with fullwidth bars):
    <think>reasoning</think>content<｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

When the rendered prompt ends inside an open `<think>` (both families' thinking mode), the output
starts as reasoning. `ChatParser` is fed text deltas and returns deltas: text that may be the start
of a marker is held back (like a stop string), a tool call is emitted whole once its block closed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        out = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def _value(raw: str, is_string: bool):
    if is_string:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # not JSON after all: the text as the model wrote it


class Glm5Markup:
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, block: str, string_params: dict[str, set[str]]) -> list[tuple[str, dict]]:
        name = block.split("<arg_key>", 1)[0].strip()
        strings = string_params.get(name, set())
        args = {k.strip(): _value(v, k.strip() in strings) for k, v in _glm_args(block)}
        return [(name, args)]


class DeepSeekV32Markup:
    start, end = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"

    def parse(self, block: str, string_params: dict[str, set[str]]) -> list[tuple[str, dict]]:
        calls = []
        for name, body in _dsml_invokes(block):
            calls.append((name, {k: _value(v, s == "true") for k, s, v in _dsml_params(body)}))
        return calls


# The markup's parts are split by str.find in one pass (linear in the block). They find what
# re.findall found with the lazy patterns these replace (quadratic on an unclosed block):
#   GLM-5:  <arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>
#   DSML:   <｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>
#           <｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜parameter>
# At the first opening tag from where the last match ended, either the pattern matches (with the
# first closing tags that fit) or no later opening tag can match either, as every closing tag a
# later one could use comes after the ones this one could.
_SPACE = re.compile(r"\s*")


def _glm_args(block: str) -> list[tuple[str, str]]:
    key, key_end, val, val_end = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    out, pos = [], 0
    while (i := block.find(key, pos)) >= 0:
        j = i + len(key)
        while True:  # the first </arg_key> followed by blanks and <arg_value>
            j = block.find(key_end, j)
            if j < 0:
                return out
            v = _SPACE.match(block, j + len(key_end)).end()
            if block.startswith(val, v):
                break
            j += 1
        k = block.find(val_end, v + len(val))
        if k < 0:
            return out
        out.append((block[i + len(key) : j], block[v + len(val) : k]))
        pos = k + len(val_end)
    return out


def _dsml_tags(block: str, opening: str, closing: str, attrs) -> list[tuple[str, ...]]:
    """(name, *attrs(block, after the name's closing quote) values..., body) per element;
    attrs -> (values, where the body starts) or None when the head does not fit."""
    out, pos = [], 0
    while (i := block.find(opening, pos)) >= 0:
        q = block.find('"', i + len(opening))
        if q < 0:
            break
        head = attrs(block, q)
        if head is None:
            pos = i + 1
            continue
        values, body = head
        k = block.find(closing, body)
        if k < 0:
            break
        out.append((block[i + len(opening) : q], *values, block[body:k]))
        pos = k + len(closing)
    return out


def _invoke_head(block: str, q: int):
    return ((), q + 2) if block.startswith('">', q) else None


def _param_head(block: str, q: int):
    t = q + len('" string="')
    if not block.startswith('" string="', q):
        return None
    for flag in ("true", "false"):
        if block.startswith(flag + '">', t):
            return (flag,), t + len(flag) + 2
    return None


def _dsml_invokes(block: str) -> list[tuple[str, str]]:
    return _dsml_tags(block, '<｜DSML｜invoke name="', "</｜DSML｜invoke>", _invoke_head)


def _dsml_params(body: str) -> list[tuple[str, str, str]]:
    return _dsml_tags(body, '<｜DSML｜parameter name="', "</｜DSML｜parameter>", _param_head)


MARKUPS = {"glm_moe_dsa": Glm5Markup, "deepseek_v32": DeepSeekV32Markup}


def markup_for(model_type: str | None):
    """The tool-call markup of a model type, or None (tools are then refused)."""
    cls = MARKUPS.get(model_type or "")
    return cls() if cls else None


class ChatParser:
    """Incremental: feed(text) -> deltas, finish() -> the last ones. A delta is one of
    {"reasoning_content": str}, {"content": str}, {"tool_call": ToolCall}.

    Linear in the text: an open tool-call block is kept as a list of pieces and only each new
    piece (plus the end marker's length - 1 before it) is searched for the end marker."""

    def __init__(self, markup, in_reasoning: bool, string_params: dict[str, set[str]] | None = None):
        self.markup, self.string_params = markup, string_params or {}
        self.state = "reasoning" if in_reasoning else "content"
        self.buf, self.started, self.calls = "", False, 0
        self.block: list[str] = []  # the open tool-call block's pieces (state "call")
        self.tail = ""  # its last len(end) - 1 characters

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        if self.state == "call":
            text = self._call(text, out)
        self.buf += text
        while self.buf:
            before = (self.state, len(self.buf))
            if self.state == "call":  # _content found a start marker: the block begins the buffer
                text, self.buf = self.buf, ""
                self.buf = self._call(text, out)
            else:
                getattr(self, f"_{self.state}")(out)
            if (self.state, len(self.buf)) == before:
                break
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        kind = "reasoning_content" if self.state == "reasoning" else "content"
        text = "".join(self.block) + self.buf  # an open tool-call block stays text: nothing was called
        if text:
            out.append({kind: text})
        self.buf, self.block, self.tail = "", [], ""
        return out

    def _reasoning(self, out: list[dict]) -> None:
        if not self.started and self.buf.startswith(THINK_START):
            self.buf = self.buf[len(THINK_START) :]
        i = self.buf.find(THINK_END)
        if i >= 0:
            self._emit(out, "reasoning_content", self.buf[:i])
            self.buf, self.state = self.buf[i + len(THINK_END) :], "content"
            return
        if not self.started and THINK_START.startswith(self.buf):
            return  # perhaps the model opens <think> itself
        self._release(out, "reasoning_content", (THINK_END,))

    def _content(self, out: list[dict]) -> None:
        if not self.started and self.buf.startswith(THINK_START):
            self.buf, self.state = self.buf[len(THINK_START) :], "reasoning"
            return
        i = self.buf.find(self.markup.start) if self.markup else -1
        if i >= 0:
            self._emit(out, "content", self.buf[:i])
            self.buf, self.state = self.buf[i:], "call"
            return
        markers = ((self.markup.start,) if self.markup else ()) + (() if self.started else (THINK_START,))
        self._release(out, "content", markers)

    def _call(self, text: str, out: list[dict]) -> str:
        """Adds `text` to the open block; once its end marker came, parses it and returns the text
        after it (the block's own text else: "")."""
        end = self.markup.end
        seen = self.tail + text
        i = seen.find(end)
        if i < 0:
            self.block.append(text)
            self.tail = seen[len(seen) - (len(end) - 1) :]
            return ""
        whole = "".join(self.block) + text
        j = len(whole) - len(seen) + i  # where the end marker begins in the block
        block, rest = whole[len(self.markup.start) : j], whole[j + len(end) :]
        self.block, self.tail, self.state = [], "", "content"
        for name, args in self.markup.parse(block, self.string_params):
            call = ToolCall(name, json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")
            out.append({"tool_call": call})
            self.calls += 1
        return rest

    def _release(self, out: list[dict], kind: str, markers: tuple[str, ...]) -> None:
        keep = max((_prefix_overlap(self.buf, m) for m in markers), default=0)
        self._emit(out, kind, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _emit(self, out: list[dict], kind: str, text: str) -> None:
        if text:
            self.started = True
            out.append({kind: text})


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
