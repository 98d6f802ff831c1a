"""A chat choice's message from the generated text: reasoning, content and tool calls split by the
model type's markup (tool_parsers.py), streamed as deltas or whole.

`ChatShaper.delta(text, final)` -> the chunk's delta ({"reasoning_content"?, "content"?,
"tool_calls"?: [{"index", "id", "type", "function": {"name", "arguments"}}]}); `message(text)` -> the
non-streamed message (content None when the answer is only tool calls). `finish_reason` turns a
"stop" into "tool_calls" once the model called a tool.
"""

from __future__ import annotations

from .tool_parsers import ChatParser
from .tools import ToolPlan


class ChatShaper:
    def __init__(self, plan: ToolPlan, in_reasoning: bool):
        markup = plan.markup if plan.tools else None  # tool markup is text unless tools were offered
        self.parser = ChatParser(markup, in_reasoning, plan.string_params)
        self.split = plan.markup is not None or in_reasoning  # a model type with markup, or a <think> prompt
        self.sent = 0  # tool calls streamed so far (their "index")

    def delta(self, text: str, final: bool) -> dict:
        if not self.split:
            return {"content": text} if text else {}
        out: dict = {}
        for p in self.parser.feed(text) + (self.parser.finish() if final else []):
            if "tool_call" in p:
                out.setdefault("tool_calls", []).append(p["tool_call"].openai(index=self.sent))
                self.sent += 1
            else:
                ((key, value),) = p.items()
                out[key] = out.get(key, "") + value
        return out

    def message(self, text: str) -> dict:
        d = self.delta(text, final=True)
        content = d.get("content", "")
        msg: dict = {"role": "assistant", "content": content}
        if d.get("reasoning_content"):
            msg["reasoning_content"] = d["reasoning_content"]
        if d.get("tool_calls"):
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in d["tool_calls"]]
            msg["content"] = content.strip() or None
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.calls else reason
