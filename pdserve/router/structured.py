"""Structured outputs at the router: response_format -> an llguidance grammar the instances enforce.

OpenAI's types: `text` (no constraint), `json_object` (any JSON object), `json_schema`
({"json_schema": {"name", "schema", "strict"?, "description"?}}). Extensions: `regex`
({"regex": "..."}) and `grammar` ({"grammar": "<Lark grammar>"}, llguidance's Lark dialect). The
grammar is compiled and validated here, off the event loop (engine/constraint.py `grammar_for`); one
llguidance cannot compile is a 400 naming the problem, before any instance is involved. The
instances build a matcher from the grammar text and mask every token it does not allow, the
prefill for the first token and the decode for the rest (engine/sampler.py).
"""

from __future__ import annotations

import asyncio
import json

from ..engine.constraint import GrammarError, grammar_for
from ..request import MAX_GRAMMAR_CHARS
from .protocol import ApiError

MAX_SPEC_CHARS = 1 << 18  # a regex, Lark grammar or JSON schema (as compact JSON) as the client sends it
# n x the compiled grammar's characters: what the instances hold for a request's choices (each
# choice's matcher is a copy of one compiled grammar, but every choice's state grows with it)
MAX_CHOICES_GRAMMAR_CHARS = 1 << 23


async def response_grammar(fmt: dict | None, tool_grammar: str | None = None) -> str | None:
    """The grammar of a request's response_format or of its forced tool call (a Lark grammar from
    tools.py; None: unconstrained), or ApiError(400)."""
    if tool_grammar is not None:
        if fmt is not None and fmt.get("type") != "text":
            raise ApiError(
                400, "response_format cannot be combined with a forced tool_choice", "response_format"
            )
        try:
            grammar = await asyncio.to_thread(grammar_for, "lark", tool_grammar)
        except GrammarError as e:
            raise ApiError(
                400, f"the tools' parameters cannot be compiled: {str(e)[:2000]}", "tools"
            ) from None
        return check_grammar_size(grammar, "tools")
    if fmt is None:
        return None
    kind, spec = _spec(fmt)
    if kind is None:
        return None
    try:
        grammar = await asyncio.to_thread(grammar_for, kind, spec)
    except GrammarError as e:
        raise ApiError(
            400, f"response_format cannot be compiled: {str(e)[:2000]}", "response_format"
        ) from None
    return check_grammar_size(grammar, "response_format")


def check_grammar_size(grammar: str, param: str) -> str:
    """The compiled grammar, or ApiError(400) when it is larger than the instances accept."""
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ApiError(
            400,
            f"{param} compiles to a grammar of {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}",
            param,
        )
    return grammar


def check_choices_grammar(grammar: str | None, n: int) -> None:
    """n choices of one grammar: ApiError(400) past MAX_CHOICES_GRAMMAR_CHARS."""
    if grammar is not None and n * len(grammar) > MAX_CHOICES_GRAMMAR_CHARS:
        raise ApiError(
            400,
            f"n = {n} choices of a {len(grammar)}-character grammar exceed {MAX_CHOICES_GRAMMAR_CHARS} "
            "characters in all: use fewer choices or a smaller schema",
            "n",
        )


def _spec(fmt: dict) -> tuple[str | None, object]:
    kind = fmt.get("type")
    allowed = {
        "text": {"type"},
        "json_object": {"type"},
        "json_schema": {"type", "json_schema"},
        "regex": {"type", "regex"},
        "grammar": {"type", "grammar"},
    }
    if not isinstance(kind, str) or kind not in allowed:  # a list or object is no type name either
        raise ApiError(
            400, f"response_format.type must be one of {', '.join(allowed)}", "response_format.type"
        )
    extra = set(fmt) - allowed[kind]
    if extra:
        raise ApiError(
            400, f"response_format has unknown fields {sorted(extra)}", f"response_format.{min(extra)}"
        )
    if kind == "text":
        return None, None
    if kind == "json_object":
        return kind, None
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ApiError(
                400,
                "response_format.json_schema must be an object with a schema",
                "response_format.json_schema",
            )
        unknown = set(js) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ApiError(
                400,
                f"response_format.json_schema has unknown fields {sorted(unknown)}",
                "response_format.json_schema",
            )
        schema = js.get("schema", {})
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > MAX_SPEC_CHARS:
            raise ApiError(
                400,
                f"response_format.json_schema.schema is {size} characters as compact JSON; at most {MAX_SPEC_CHARS}",
                "response_format.json_schema.schema",
            )
        return kind, schema
    spec = fmt.get(kind)
    if not isinstance(spec, str) or not 0 < len(spec) <= MAX_SPEC_CHARS:
        raise ApiError(
            400,
            f"response_format.{kind} must be a string of 1 to {MAX_SPEC_CHARS} characters",
            f"response_format.{kind}",
        )
    return ("lark" if kind == "grammar" else kind), spec
