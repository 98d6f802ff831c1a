"""The prompt at the router's edge: size limits, then tokenizing and chat templates off the event loop.

A prompt is checked in bytes before it is tokenized (`max_prompt_bytes`) and in tokens after
(`max_prompt_tokens`); token ids must lie inside the vocabulary. Tokenizing and template rendering
run in worker threads (the tokenizer releases the GIL for long texts), so /health and the streams
of other requests keep being served while a large prompt is processed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from ..model.tokenizer import Tokenizer
from .protocol import ApiError

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_bytes: int
    max_prompt_tokens: int


async def completion_prompt(tok: Tokenizer, prompt, limits: PromptLimits) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        raise ApiError(400, "only one prompt per request is supported", "prompt")
    if isinstance(prompt, str):
        _check_bytes(len(prompt.encode("utf-8", "surrogatepass")), limits)
        return await asyncio.to_thread(_encode_checked, tok, prompt, limits)
    return await asyncio.to_thread(_check_ids, list(prompt), tok.vocab_size, limits)


async def chat_prompt(
    tok: Tokenizer, messages: list[dict], limits: PromptLimits, **template_kwargs
) -> tuple[list[int], str]:
    """(token ids, rendered text); template_kwargs (tools, enable_thinking, ...) reach the template."""
    flat = flatten_messages(messages)
    _check_bytes(
        sum(len(json.dumps(m, ensure_ascii=False).encode("utf-8", "surrogatepass")) for m in flat), limits
    )
    try:
        text = await asyncio.to_thread(tok.apply_chat_template, flat, True, **template_kwargs)
    except Exception as e:  # jinja's raise_exception(), or no template
        raise ApiError(400, f"cannot apply the chat template: {e}", "messages") from None
    _check_bytes(len(text.encode("utf-8", "surrogatepass")), limits)
    return await asyncio.to_thread(_encode_checked, tok, text, limits), text


def _encode_checked(tok: Tokenizer, text: str, limits: PromptLimits) -> list[int]:
    """In a worker thread: tokenizing and the per-id check of a long prompt both take a while."""
    return _check_ids(tok.encode(text), tok.vocab_size, limits)


def flatten_messages(messages: list[dict]) -> list[dict]:
    """Each message as {"role", "content": str[, "name", "tool_calls" (arguments as objects, as
    templates write them), "tool_call_id", "reasoning_content"]}; anything malformed is a 400."""
    if not messages:
        raise ApiError(400, "messages must not be empty", "messages")
    flat = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(
                400, f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
                raise ApiError(
                    400, f"messages[{i}].content parts must be objects with a text", f"messages[{i}].content"
                )
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(
                400, f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content"
            )
        entry = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            entry["name"] = m["name"][:256]
        for key in ("tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise ApiError(400, f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
                entry[key] = m[key]
        if m.get("tool_calls"):
            entry["tool_calls"] = _tool_calls(i, m["tool_calls"])
        flat.append(entry)
    return flat


def _tool_calls(i: int, calls) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (
            isinstance(f, dict)
            and isinstance(f.get("name"), str)
            and isinstance(f.get("arguments", "{}"), str)
        ):
            raise ApiError(
                400, f"{where}[{j}] must have a function with a name and arguments (a JSON string)", where
            )
        try:
            args = json.loads(f.get("arguments", "{}") or "{}")
        except ValueError:
            raise ApiError(400, f"{where}[{j}].function.arguments is not JSON", where) from None
        if not isinstance(args, dict):
            raise ApiError(400, f"{where}[{j}].function.arguments must be a JSON object", where)
        out.append(
            {
                "id": str(c.get("id", "")),
                "type": "function",
                "function": {"name": f["name"], "arguments": args},
            }
        )
    return out


def _check_bytes(n: int, limits: PromptLimits) -> None:
    if n > limits.max_prompt_bytes:
        raise ApiError(
            400,
            f"the prompt is {n} bytes, more than this server accepts ({limits.max_prompt_bytes})",
            "prompt",
            "context_length_exceeded",
        )


def _check_ids(ids: list[int], vocab: int, limits: PromptLimits) -> list[int]:
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    if len(ids) > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt is {len(ids)} tokens, more than this server accepts ({limits.max_prompt_tokens})",
            "prompt",
            "context_length_exceeded",
        )
    if any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids
