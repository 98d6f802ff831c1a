"""Tool-call and reasoning markup of GLM-5 (glm_moe_dsa) and DeepSeek-V3.2 (deepseek_v32): the
chat templates in tests/data/templates (written for these tests, equivalent in the markup the
released templates define) render an assistant's tool calls, and the parser of that model type
reads the rendering back into the same calls, whole or fed in any chunking; reasoning is split out
whether the prompt opened <think> or the model did; tool_choice's forced grammar compiles."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from pdserve.engine.constraint import grammar_for
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.chat import ChatShaper
from pdserve.router.protocol import ApiError
from pdserve.router.tool_parsers import ChatParser, markup_for
from pdserve.router.tools import forced_grammar, plan_tools, prompt_opens_reasoning

TEMPLATES = Path(__file__).parent.parent / "data" / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                    "units": {"enum": ["c", "f"]},
                },
                "required": ["city", "days", "units"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [("get_weather", {"city": "Paris <3", "days": 3, "units": "c"}), ("noop", {})]


def tokenizer_with(model_dir, model_type: str, tmp_path) -> Tokenizer:
    d = tmp_path / model_type
    shutil.copytree(model_dir, d)
    shutil.copy(TEMPLATES / f"{model_type}.jinja", d / "chat_template.jinja")
    return Tokenizer.from_pretrained(d)


def rendered_answer(tok: Tokenizer, kwargs: dict) -> tuple[str, str]:
    """(the prompt before the assistant turn, the assistant turn as the template writes it)."""
    history = [{"role": "user", "content": "weather?"}]
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(CALLS)
    ]
    answer = {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "think first",
        "tool_calls": calls,
    }
    before = tok.apply_chat_template(history, add_generation_prompt=False, tools=TOOLS, **kwargs)
    full = tok.apply_chat_template([*history, answer], add_generation_prompt=False, tools=TOOLS, **kwargs)
    assert full.startswith(before)
    return before, full[len(before) :]


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_the_parser_reads_back_what_the_template_writes(model_dir, model_type, tmp_path):
    tok = tokenizer_with(model_dir, model_type, tmp_path)
    _, turn = rendered_answer(tok, {})
    # the generated part: what follows the generation prompt (role marker, and <think> for GLM-5)
    gen_prompt = tok.apply_chat_template([{"role": "user", "content": "weather?"}], tools=TOOLS)
    opens = prompt_opens_reasoning(gen_prompt)
    assert opens == (model_type == "glm_moe_dsa")  # GLM-5 thinks by default, DeepSeek-V3.2 chats
    marker = "<|assistant|><think>" if opens else "<｜Assistant｜></think>"
    generated = turn.split(marker, 1)[1].replace("<｜end▁of▁sentence｜>", "")
    plan = plan_tools(TOOLS, "auto", model_type)
    want_reasoning = "think first" if opens else ""
    for chunking in ([len(generated)], [1] * len(generated), None):
        sizes = chunking or [random.Random(7).randint(1, 9) for _ in range(len(generated))]
        parser, parts, i = ChatParser(plan.markup, opens, plan.string_params), [], 0
        for n in sizes:
            parts += parser.feed(generated[i : i + n])
            i += n
        parts += parser.finish()
        calls = [
            (p["tool_call"].name, json.loads(p["tool_call"].arguments)) for p in parts if "tool_call" in p
        ]
        assert calls == CALLS
        assert "".join(p.get("reasoning_content", "") for p in parts) == want_reasoning
        assert "".join(p.get("content", "") for p in parts).strip() == "Let me look."


def test_reasoning_split_and_plain_text():
    glm = markup_for("glm_moe_dsa")
    shaper = ChatShaper(plan_tools(None, None, "glm_moe_dsa"), in_reasoning=False)
    msg = shaper.message("<think>hmm</think>The answer <tool_call>x</tool_call>")
    assert msg == {
        "role": "assistant",
        "content": "The answer <tool_call>x</tool_call>",
        "reasoning_content": "hmm",
    }
    assert shaper.finish_reason("stop") == "stop"  # no tools offered: markup stays text
    shaper = ChatShaper(plan_tools(TOOLS, "auto", "glm_moe_dsa"), in_reasoning=True)
    deltas = [shaper.delta(t, False) for t in ("abc</th", "ink>hi <tool", "_call>noop</tool_call>")]
    deltas.append(shaper.delta("", True))
    assert deltas[0] == {"reasoning_content": "abc"} and deltas[1] == {"content": "hi "}
    assert deltas[2]["tool_calls"][0]["function"] == {"name": "noop", "arguments": "{}"}
    assert deltas[2]["tool_calls"][0]["index"] == 0 and shaper.finish_reason("stop") == "tool_calls"
    unclosed = ChatParser(glm, in_reasoning=False)
    assert unclosed.feed("a <tool_call>x") == [{"content": "a "}] and unclosed.finish() == [
        {"content": "<tool_call>x"}
    ]


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_grammar_compiles(model_type, choice):
    plan = plan_tools(TOOLS, choice, model_type)
    for thinking in (False, True):
        grammar_for("lark", forced_grammar(plan, thinking))


def test_bad_tools_are_400s_naming_them():
    for tools, choice, model_type, param in (
        (TOOLS, "auto", "deepseek_v3", "tools"),
        ([{"type": "code"}], "auto", "glm_moe_dsa", "tools[0]"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "glm_moe_dsa", "tool_choice"),
        (TOOLS, "sometimes", "glm_moe_dsa", "tool_choice"),
        (None, "required", "glm_moe_dsa", "tool_choice"),
        (
            [{"type": "function", "function": {"name": "a b"}}],
            "auto",
            "glm_moe_dsa",
            "tools[0].function.name",
        ),
    ):
        with pytest.raises(ApiError) as e:
            plan_tools(tools, choice, model_type)
        assert e.value.status == 400 and e.value.param == param
