"""Tokenizer loading, chat template, incremental detokenization, BPE determinism."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from pdserve.checkpoints import bpe_builder
from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "héllo wörld 😀 def f(x): return x"
MULTIBYTE = "naïve café — 你好，世界 😀🚀 Ωμέγα ok"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
]
EXPECTED_CHAT = (
    "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.<|endoftext|>\n<|user|>\nBye\n<|assistant|>\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tok") / "m", "glm_moe_dsa", "tiny")


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def test_special_token_ids(tok, model_dir):
    assert [tok.encode(t) for t in bpe_builder.SPECIAL_TOKENS] == [[0], [1], [2], [3]]
    cfg = json.loads((model_dir / "config.json").read_text())
    assert tok.eos_token_id == cfg["eos_token_id"] == 0
    assert tok.bos_token_id == cfg["bos_token_id"] == 0
    assert tok.pad_token_id == 0
    assert tok.eos_token_ids == [0]
    assert tok.vocab_size == cfg["vocab_size"] == 512


def test_roundtrip_and_ids_in_range(tok):
    for text in (TEXT, MULTIBYTE, bpe_builder.CORPUS):
        ids = tok.encode(text)
        assert max(ids) < tok.vocab_size
        assert tok.decode(ids) == text


def test_small_vocab_is_filled_and_in_range():
    small = bpe_builder.build_tokenizer(4096)
    assert small.get_vocab_size() == 4096
    ids = small.encode(bpe_builder.CORPUS + MULTIBYTE + " 123456789").ids
    assert max(ids) < 4096
    # Every id decodes, since a model may sample any of them.
    assert all(small.id_to_token(i) is not None for i in range(4096))


def test_bpe_is_deterministic_across_processes():
    here = hashlib.sha256(bpe_builder.build_tokenizer(512).to_str(pretty=True).encode()).hexdigest()
    code = (
        "import hashlib; from pdserve.checkpoints import bpe_builder as b; "
        "print(hashlib.sha256(b.build_tokenizer(512).to_str(pretty=True).encode()).hexdigest())"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_matches_transformers(tok, model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    for text in (TEXT, MULTIBYTE, "<|user|>\nhi<|endoftext|>"):
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
        assert hf.encode(text) == tok.encode(text, add_special_tokens=True)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 0, 0)
    rendered = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(MESSAGES) == EXPECTED_CHAT


def test_chat_template(tok):
    assert (
        tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=False)
        == "<|system|>\nBe brief.\n<|user|>\nHi\n"
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer.from_pretrained(tmp_path)
    assert bare.encode(TEXT) == Tokenizer.from_pretrained(model_dir).encode(TEXT)
    with pytest.raises(ValueError, match="no chat_template"):
        bare.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_pretrained(tmp_path)


def test_eos_ids_merge_generation_config(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 0]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == [0, 3]


def test_incremental_detokenizer_reproduces_text(tok):
    text = TEXT + " " + MULTIBYTE
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add_token(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text
    assert detok.flush() == ""
    # Some tokens end mid-character, so some steps must have held text back.
    assert "" in pieces


def test_incremental_detokenizer_specials(tok):
    ids = tok.encode("<|assistant|>\nhé<|endoftext|>")
    assert "".join(tok.detokenizer().add_token(i) for i in ids) == "\nhé"
    keep = tok.detokenizer(skip_special_tokens=False)
    assert keep.add_tokens(ids) + keep.flush() == "<|assistant|>\nhé<|endoftext|>"


def test_incremental_detokenizer_flushes_incomplete_tail(tok):
    ids = tok.encode("😀")
    detok = tok.detokenizer()
    assert detok.add_tokens(ids[:-1]) == ""
    assert detok.flush().endswith("\ufffd")
