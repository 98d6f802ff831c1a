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
    _arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, block: str, string_params: dict[str, set[str]]) -> list[tuple[str, dict]]:
        name = block.split("<arg_key>", 1)[0].strip()
        strings = string_params.get(name, set())
        args = {k.strip(): _value(v, k.strip() in strings) for k, v in self._arg.findall(block)}
        return [(name, args)]


class DeepSeekV32Markup:
    start, end = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
    _invoke = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>', re.S)
    _param = re.compile(
        r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.S
    )

    def parse(self, block: str, string_params: dict[str, set[str]]) -> list[tuple[str, dict]]:
        calls = []
        for name, body in self._invoke.findall(block):
            calls.append((name, {k: _value(v, s == "true") for k, s, v in self._param.findall(body)}))
        return calls


MARKUPS = {"glm_moe_dsa": Glm5Markup, "deepseek_v32": DeepSeekV32Markup}


def markup_for(model_type: str | None):
    """The tool-call markup of a model type, or None (tools are then refused)."""
    cls = MARKUPS.get(model_type or "")
    return cls() if cls else None


class ChatParser:
    """Incremental: feed(text) -> deltas, finish() -> the last ones. A delta is one of
    {"reasoning_content": str}, {"content": str}, {"tool_call": ToolCall}."""

    def __init__(self, markup, in_reasoning: bool, string_params: dict[str, set[str]] | None = None):
        self.markup, self.string_params = markup, string_params or {}
        self.state = "reasoning" if in_reasoning else "content"
        self.buf, self.started, self.calls = "", False, 0

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, f"_{self.state}")(out)
            if (self.state, len(self.buf)) == before:
                break
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        kind = "reasoning_content" if self.state == "reasoning" else "content"
        if self.buf:  # an open tool-call block stays text: nothing was called
            out.append({kind: self.buf})
        self.buf = ""
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

    def _call(self, out: list[dict]) -> None:
        i = self.buf.find(self.markup.end)
        if i < 0:
            return  # the block is still open
        block = self.buf[len(self.markup.start) : i]
        self.buf, self.state = self.buf[i + len(self.markup.end) :], "content"
        for name, args in self.markup.parse(block, self.string_params):
            call = ToolCall(name, json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")
            out.append({"tool_call": call})
            self.calls += 1

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
