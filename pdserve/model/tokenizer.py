"""Tokenizer loading, chat templates and incremental detokenization.

Reads a Hugging Face model directory with the ``tokenizers`` library directly (no
transformers at serving time) and renders chat templates the way transformers does, so a
prompt tokenized here matches ``AutoTokenizer`` token for token.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Same as transformers' override: jinja's built-in tojson HTML-escapes, which templates don't want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    # Mirrors transformers' environment so templates from the Hub render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _load_chat_template(model_dir: Path, tok_config: dict) -> str | None:
    # Newer checkpoints keep the template in its own file; it takes precedence as in transformers.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def decodable_vocab(model_dir: str | Path, vocab_size: int) -> int:
    """How many ids a model with `vocab_size` LM-head rows may emit: its tokenizer's size (the bound
    the router checks prompt ids against, `Tokenizer.vocab_size`) when that is smaller (a checkpoint
    may pad its LM head past the tokenizer: those ids decode to nothing and would be refused when a
    client sends its conversation back), else vocab_size; vocab_size when the model directory has no
    tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return vocab_size
    return min(vocab_size, _HFTokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True))


class Tokenizer:
    """A ``tokenizer.json`` plus the special tokens and chat template of a model directory."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        tok_config: dict | None = None,
        chat_template: str | None = None,
        extra_eos_ids: list[int] | None = None,
    ):
        self._tok = tokenizer
        cfg = tok_config or {}
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.pad_token = _token_content(cfg.get("pad_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        self.model_max_length = cfg.get("model_max_length")
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        ids = [self.eos_token_id] if self.eos_token_id is not None else []
        for i in extra_eos_ids or []:
            if i not in ids:
                ids.append(i)
        self._eos_ids = ids

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        tok = _HFTokenizer.from_file(str(path))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        # Stop ids may also come from the generation config (e.g. several end-of-turn tokens).
        extra = _as_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
        extra += _as_id_list(_read_json(model_dir / "config.json").get("eos_token_id"))
        return cls(tok, tok_config, _load_chat_template(model_dir, tok_config), extra)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos_ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > 4096:  # the batch call releases the GIL, so a long text does not stall other threads
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template (extra kwargs, e.g. tools, pass through)."""
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat_template (tokenizer_config.json / chat_template.jinja)"
            )
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    One token may end in the middle of a multi-byte UTF-8 character, which decodes to
    U+FFFD; such text is held back until later tokens complete it.  Each step decodes a
    short window that starts one already-emitted chunk back, so decoders that depend on
    the previous token (e.g. a leading-space rule) still produce the right delta.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this have been emitted as text

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is unfinished)."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def add_tokens(self, token_ids: list[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """Return whatever is held back (it may contain U+FFFD if the stream ended mid-character)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]
