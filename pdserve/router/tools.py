"""Tools at the router: the request's `tools` / `tool_choice` checked, rendered through the
checkpoint's chat template, and (for `required` or a named function) forced with a grammar written
in the model's own markup, so the usual parser (tool_parsers.py) reads the answer back.

tool_choice: "none" (the template sees no tools), "auto" (default with tools: the model decides),
"required" (at least one call of any tool), {"type": "function", "function": {"name": N}} (one call
of N). A forced call's string arguments are free text without "<" (at most the parameter's
maxLength when it has one), the others follow their JSON schema (llguidance's %json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .protocol import ApiError
from .tool_parsers import THINK_START, DeepSeekV32Markup, Glm5Markup, markup_for

MAX_NAME = 64


@dataclass(frozen=True)
class ToolPlan:
    markup: object  # tool_parsers markup, None: no tools
    tools: list[dict] = field(default_factory=list)  # passed to the chat template
    forced: str | None = None  # "required" or a function name
    string_params: dict[str, set[str]] = field(default_factory=dict)

    def template_kwargs(self) -> dict:
        return {"tools": self.tools} if self.tools else {}


def plan_tools(tools: list[dict] | None, tool_choice, model_type: str | None) -> ToolPlan:
    """ApiError(400) naming the field for anything this router cannot honour."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ApiError(400, "tool_choice needs tools", "tool_choice")
    if not tools or tool_choice == "none":
        return ToolPlan(markup_for(model_type))
    markup = markup_for(model_type)
    if markup is None:
        raise ApiError(400, f"tools are not supported for model type {model_type!r}", "tools")
    functions = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool names must be unique", "tools")
    forced = None
    if tool_choice == "required":
        forced = "required"
    elif isinstance(tool_choice, dict):
        name = (
            (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        )
        if name not in names:
            raise ApiError(400, "tool_choice must name one of the tools", "tool_choice")
        forced = name
    elif tool_choice not in (None, "auto"):
        raise ApiError(400, "tool_choice must be none, auto, required or a function", "tool_choice")
    strings = {f["name"]: _string_params(f) for f in functions}
    return ToolPlan(markup, [{"type": "function", "function": f} for f in functions], forced, strings)


def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise ApiError(400, f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
    f = tool["function"]
    unknown = set(f) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ApiError(400, f"{where}.function has unknown fields {sorted(unknown)}", f"{where}.function")
    name = f.get("name")
    if not (
        isinstance(name, str) and 0 < len(name) <= MAX_NAME and all(c.isalnum() or c in "_-." for c in name)
    ):
        raise ApiError(
            400,
            f"{where}.function.name must be 1-{MAX_NAME} of a-z, A-Z, 0-9, _ - .",
            f"{where}.function.name",
        )
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
        raise ApiError(
            400, f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters"
        )
    return {**f, "parameters": params}


def _string_params(f: dict) -> set[str]:
    props = f["parameters"].get("properties", {})
    return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside <think>: the output starts as reasoning."""
    return prompt_text.rstrip().endswith(THINK_START)


def forced_grammar(plan: ToolPlan, in_reasoning: bool) -> str | None:
    """A Lark grammar (llguidance's dialect) of the model's markup for a forced call, or None."""
    if plan.forced is None:
        return None
    functions = [t["function"] for t in plan.tools if plan.forced in ("required", t["function"]["name"])]
    rules, alts = [], []
    for i, f in enumerate(functions):
        alts.append(f"call{i}")
        rules += _call_rules(plan.markup, f, f"call{i}", i)
    head = '"</think>" ' if in_reasoning else ""
    if isinstance(plan.markup, DeepSeekV32Markup):
        body = f'{head}"{_esc(plan.markup.start)}\\n" invoke "{_esc(plan.markup.end)}"'
    else:
        body = f"{head}invoke"
    lines = [f"start: {body}", "invoke: " + " | ".join(alts), *rules]
    return "\n".join(lines)


def _call_rules(markup, f: dict, rule: str, i: int) -> list[str]:
    props = f["parameters"].get("properties", {})
    parts, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        value = f"v{i}_{j}"
        if isinstance(schema, dict) and schema.get("type") == "string":
            n = schema.get("maxLength")
            bound = f"{{0,{int(n)}}}" if isinstance(n, int) and n >= 0 else "*"
            rules.append(f"{value.upper()}: /[^<]{bound}/")
            value = value.upper()
        else:
            rules.append(f"{value}: %json{json.dumps(schema if isinstance(schema, dict) else {})}")
        if isinstance(markup, Glm5Markup):
            parts.append(f'"<arg_key>{_esc(key)}</arg_key><arg_value>" {value} "</arg_value>"')
        else:
            flag = "true" if value.isupper() else "false"
            parts.append(
                f'"<｜DSML｜parameter name=\\"{_esc(key)}\\" string=\\"{flag}\\">" {value} "</｜DSML｜parameter>\\n"'
            )
    name = _esc(f["name"])
    if isinstance(markup, Glm5Markup):
        rules.insert(0, f'{rule}: "<tool_call>{name}" {" ".join(parts)} "</tool_call>"')
    else:
        rules.insert(
            0, f'{rule}: "<｜DSML｜invoke name=\\"{name}\\">\\n" {" ".join(parts)} "</｜DSML｜invoke>\\n"'
        )
    return rules


def _esc(text: str) -> str:
    return json.dumps(text)[1:-1]
