"""Deterministic byte-level BPE tokenizer for the random checkpoints.

The merges are learned by a small BPE loop written here rather than by the ``tokenizers``
trainer: the trainer counts words in parallel hash maps, and we want the same
``tokenizer.json`` bytes on every run and every machine.  Ties between equally frequent
pairs are broken by the pair's strings, so the result depends only on the corpus.

Id layout (stable for every vocab size):
  0..3     special tokens (``SPECIAL_TOKENS``)
  4..259   the 256 bytes, in byte order, in ByteLevel's printable alphabet
  260..    merged tokens, in merge order
"""

from __future__ import annotations

import functools
import heapq
import json
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
# GPT-2 convention: one <|endoftext|> token is bos, eos and pad.
EOS_TOKEN_ID = 0
BOS_TOKEN_ID = 0
PAD_TOKEN_ID = 0
NUM_BASE_TOKENS = len(SPECIAL_TOKENS) + 256

# Each message is "<|role|>\n" + content (+ eos for assistant turns, so a model learns to
# stop) + "\n".  Content may be a string or a list of OpenAI-style parts; only text parts
# are rendered.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role: ' ~ message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of ByteLevel)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer() -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _word_counts(text: str) -> list[tuple[tuple[str, ...], int]]:
    """Split the corpus exactly as the runtime pre-tokenizer will, then count words."""
    counts = Counter(piece for piece, _ in _pre_tokenizer().pre_tokenize_str(text))
    # Sorted so the word indices (and hence everything after) are independent of hashing.
    return [(tuple(word), n) for word, n in sorted(counts.items())]


def _pairs(symbols: list[str]) -> Counter:
    return Counter(zip(symbols, symbols[1:]))


def _apply_merge(symbols: list[str], pair: tuple[str, str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


class _PairStats:
    """Pair counts over the corpus words, with a lazy max-heap for the next merge."""

    def __init__(self, words: list[tuple[tuple[str, ...], int]]):
        self.symbols = [list(w) for w, _ in words]
        self.freq = [n for _, n in words]
        self.count: Counter = Counter()
        self.where: dict[tuple[str, str], set[int]] = {}
        for idx, syms in enumerate(self.symbols):
            self._add(idx, syms, +1)
        # Heap entries are (-count, pair); an entry is stale if the count has changed.
        self.heap = [(-n, p) for p, n in self.count.items()]
        heapq.heapify(self.heap)

    def _add(self, idx: int, syms: list[str], sign: int) -> None:
        for pair, k in _pairs(syms).items():
            self.count[pair] += sign * k * self.freq[idx]
            if sign > 0:
                self.where.setdefault(pair, set()).add(idx)

    def pop_best(self) -> tuple[str, str] | None:
        while self.heap:
            neg, pair = heapq.heappop(self.heap)
            if self.count.get(pair, 0) == -neg and -neg > 0:
                return pair
        return None

    def merge(self, pair: tuple[str, str]) -> None:
        before = {}
        for idx in sorted(self.where.pop(pair, ())):
            old = self.symbols[idx]
            new = _apply_merge(old, pair)
            if new == old:
                continue
            for p in _pairs(old) | _pairs(new):
                before.setdefault(p, self.count.get(p, 0))
            self._add(idx, old, -1)
            self._add(idx, new, +1)
            self.symbols[idx] = new
        for p in sorted(before):
            n = self.count.get(p, 0)
            if n != before[p] and n > 0:
                heapq.heappush(self.heap, (-n, p))


def learn_bpe(text: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Learn merges until the vocab holds ``vocab_size`` tokens or no pair is left."""
    byte_chars = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[byte_chars[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    stats = _PairStats(_word_counts(text))
    while len(vocab) < vocab_size:
        pair = stats.pop_best()
        if pair is None:
            break
        stats.merge(pair)
        if pair not in seen:
            seen.add(pair)
            merges.append(pair)
        # Two different pairs can spell the same string; the token keeps its first id.
        vocab.setdefault(pair[0] + pair[1], len(vocab))
    return vocab, merges


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` with at most ``vocab_size`` tokens."""
    if vocab_size < NUM_BASE_TOKENS:
        raise ValueError(f"vocab_size must be at least {NUM_BASE_TOKENS}, got {vocab_size}")
    vocab, merges = learn_bpe(CORPUS, vocab_size)
    if len(vocab) < vocab_size:
        # The prose runs out of pairs around 1.5k tokens.  A model samples from its whole
        # vocab, so every id should decode to something: continue with number words, which
        # supply thousands more (realistic enough: real vocabs hold many number tokens).
        vocab, merges = learn_bpe(CORPUS + _NUMBERS, vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


@functools.lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """The ``tokenizer.json`` text; cached because tests build many checkpoints."""
    return build_tokenizer(vocab_size).to_str(pretty=True) + "\n"


def tokenizer_config(model_max_length: int | None = None) -> dict:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        cfg["model_max_length"] = model_max_length
    return cfg


def special_tokens_map() -> dict:
    return {
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
    }


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_tokenizer_files(out_dir: str | Path, vocab_size: int, model_max_length: int | None = None) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(tokenizer_json(vocab_size), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config(model_max_length)), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(_dump(special_tokens_map()), encoding="utf-8")


_NUMBERS = " ".join(str(i) for i in range(10000))

# The training corpus: a few KB of English prose and code, plus a little non-ASCII so some
# multi-byte sequences get merged.  Changing it changes every generated tokenizer.
CORPUS = r'''
The quick brown fox jumps over the lazy dog. A serving system splits the work of a
language model into two phases: prefill, which reads the whole prompt at once, and
decode, which produces one token at a time. Prefill is limited by compute, while decode
is limited by memory bandwidth, so it often pays to run them on different machines and
to move the key-value cache from one to the other.

Long documents are expensive to attend over. Sparse attention lets each query look at a
small number of selected positions instead of the whole context. An indexer scores every
earlier token with a cheap projection, keeps the top scoring ones, and the main attention
only reads those. The cache stores a compressed latent vector for each token, which is
much smaller than the full keys and values of every head.

In the morning the city was quiet. People walked to work along the river, where the
water was still and grey. A small boat moved slowly under the old stone bridge, and a
bird sat on the railing, watching the light change over the roofs. By noon the streets
were full of noise: buses, bicycles, children running home from school, and the smell of
bread from the bakery on the corner. She opened the window, read the letter again, and
decided that she would finally answer it before the end of the week.

History is written by people who keep records. Some of the oldest texts we have are lists
of grain, taxes and debts, because numbers mattered to those who governed. Later came
laws, letters, poems and stories. Each new way of writing changed what could be
remembered, who could remember it, and how long it would last.

Questions and answers:
Q: What is the capital of France? A: Paris.
Q: How many days are there in a week? A: Seven.
Q: What is two plus three? A: Five.
Q: Why is the sky blue? A: Because air scatters short wavelengths of light more strongly.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 100 128 256 512 1000 1024 2048 4096 8192 65536
3.14159 2.71828 1e-6 0.5 -1 +1 100% $20 #1 @user 2024-01-15 12:30:45

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Request:
    def __init__(self, request_id: str, prompt: list[int], max_tokens: int = 16):
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output: list[int] = []

    def is_finished(self) -> bool:
        return len(self.output) >= self.max_tokens


def main():
    import json
    import sys
    data = json.load(sys.stdin)
    for key, value in sorted(data.items()):
        print(f"{key}: {value}")
    if not data:
        raise ValueError("empty input")


if __name__ == "__main__":
    main()

import torch
x = torch.randn(4, 8)
y = torch.nn.functional.softmax(x @ x.T, dim=-1)
print(y.shape, y.sum(dim=-1))

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message.length;
}

for (let i = 0; i < 10; i++) {
  if (i % 2 === 0) {
    continue;
  }
  greet("world " + i);
}

fn main() {
    let mut total: u64 = 0;
    for value in [1, 2, 3, 4].iter() {
        total += value * value;
    }
    println!("total = {}", total);
}

#include <stdio.h>
int main(void) {
    printf("hello, world\n");
    return 0;
}

SELECT name, count(*) AS total FROM users WHERE active = 1 GROUP BY name ORDER BY total DESC;

$ git status
$ python -m pytest -q tests/
$ curl -s http://localhost:8000/v1/completions -d '{"prompt": "hi", "max_tokens": 8}'

{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}

<html><body><p>This is a paragraph.</p><a href="https://example.com">link</a></body></html>

Errors and warnings: TypeError: expected str, got int. ValueError: invalid literal.
FileNotFoundError: No such file or directory. KeyError: 'weight'. Traceback (most recent
call last): File "main.py", line 3, in <module>.

Grüße aus München! Ça va très bien, merci. El niño comió una manzana. Добрый день.
你好，世界。こんにちは。안녕하세요. café naïve résumé façade señor über Ärger.
Emoji: 😀 🚀 ✨ 👍 — “quotes” ‘single’ … € £ ¥ © ® ™ ± × ÷ ≤ ≥ ≠ → ← ∞ λ π Σ.

The model reads the prompt, thinks for a while, and answers. The user asks another
question, and the assistant answers again. The system message sets the rules of the
conversation, and the assistant should follow them. When the answer is complete the
model writes an end of text token and the server stops generating.
'''
