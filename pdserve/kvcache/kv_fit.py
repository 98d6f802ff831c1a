"""Whether a request fits a decode instance's KV cache: the one rule the router admits by and the
decode scheduler refuses by (torch-free: the router imports it).

A decode instance reserves, at admission, every slot a request can ever write: each of its n choices
gets pages of its own for prompt_len + max_tokens - 1 tokens (the last sampled token is never fed
back, so it never needs a slot), in whole pages. The request fits an instance when those pages fit
its capacity (all of its pages: `fits(..., capacity_tokens)` says whether it can ever run there; its
free and evictable pages: whether it can run now). Counting tokens instead of pages (n x (prompt +
max_tokens)) admits what whole pages refuse when several choices share a short prompt, and refuses
the request that fills the cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


def slots_per_choice(prompt_len: int, max_tokens: int) -> int:
    """KV slots one choice writes: the prompt and every sampled token but the last."""
    return prompt_len + max_tokens - 1


def kv_tokens(prompt_len: int, max_tokens: int, n: int, page_size: int) -> int:
    """KV slots a decode instance reserves for the request: n choices, each in whole pages."""
    if prompt_len < 1 or max_tokens < 1 or n < 1 or page_size < 1:
        raise ValueError(
            f"prompt_len, max_tokens, n and page_size must be positive, got "
            f"{prompt_len}, {max_tokens}, {n}, {page_size}"
        )
    pages = -(-slots_per_choice(prompt_len, max_tokens) // page_size)
    return n * pages * page_size


def fits(prompt_len: int, max_tokens: int, n: int, page_size: int, capacity_tokens: int) -> bool:
    """Whether the request's pages fit `capacity_tokens` slots (whole pages of `page_size`)."""
    return kv_tokens(prompt_len, max_tokens, n, page_size) <= capacity_tokens


@dataclass(frozen=True)
class Need:
    """A request's size as the router carries it: what it takes depends on each instance's page size."""

    prompt_len: int
    max_tokens: int
    n: int = 1

    def tokens(self, page_size: int) -> int:
        return kv_tokens(self.prompt_len, self.max_tokens, self.n, page_size)

    def fits(self, page_size: int, capacity_tokens: int) -> bool:
        return fits(self.prompt_len, self.max_tokens, self.n, page_size, capacity_tokens)

    def __str__(self) -> str:
        each = f" for each of {self.n} choices" if self.n > 1 else ""
        return f"prompt {self.prompt_len} + max_tokens {self.max_tokens}{each}"
