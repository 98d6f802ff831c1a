"""The cluster secret and what is derived from it (docs/design.md invariant 11). Torch-free.

One internal token per deployment authenticates everything between pdserve's own processes:
- instance HTTP APIs (everything but /health and /live) require `Authorization: Bearer <token>`;
  the router sends it;
- an instance proves it holds the token before the router sends it the token: a request with
  `X-PDServe-Challenge: <nonce>` (on the open /health too) gets `X-PDServe-Proof:
  <token_proof(token, nonce, the Host it was addressed as)>` (router/instance_auth.py checks it);
- side-channel and TCP data-path frames carry an HMAC-SHA256 tag under a key derived from it
  (`frame_key`), so a peer without the token can neither reserve, abort nor write.
The token comes from `--internal-token`, `--internal-token-file` or the environment variable
PDSERVE_INTERNAL_TOKEN (`pdserve up` makes one per stack and passes it only through the
environment, never on a command line). Weak tokens are refused at startup.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from .. import env

INTERNAL_TOKEN_ENV = env.INTERNAL_TOKEN.name
MIN_TOKEN_CHARS = 24
WEAK = {"change-me", "changeme", "password", "secret", "token", "admin", "pdserve", "test", "default"}
MAC_BYTES = 32


class AuthConfigError(ValueError):
    """A missing or weak token: the process must not start."""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def check_strength(token: str, what: str) -> str:
    """Returns the token, or raises AuthConfigError saying why it is too weak."""
    t = token.strip()
    if len(t) < MIN_TOKEN_CHARS or t.lower() in WEAK or len(set(t)) < 8:
        raise AuthConfigError(
            f"{what} is too weak: use at least {MIN_TOKEN_CHARS} random characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return t


def load_internal_token(
    flag: str | None = None, file: str | None = None, required: bool = True
) -> str | None:
    """--internal-token, else --internal-token-file, else $PDSERVE_INTERNAL_TOKEN; checked for strength."""
    token = flag
    if token is None and file is not None:
        try:
            token = Path(file).read_text().strip()
        except OSError as e:
            raise AuthConfigError(f"cannot read --internal-token-file {file}: {e.strerror}") from None
    if token is None:
        token = env.INTERNAL_TOKEN.text()
    if token is None:
        if required:
            raise AuthConfigError(
                f"no internal token: set {INTERNAL_TOKEN_ENV} (or --internal-token-file) to the "
                "same secret on the router and every instance (`pdserve up` makes one itself)"
            )
        return None
    return check_strength(token, "the internal token")


def require_token(token: str | None) -> str:
    """A server's start: its token must be there (the CLI loads and checks it)."""
    if token is None:
        raise AuthConfigError(f"no internal token: set {INTERNAL_TOKEN_ENV} (or --internal-token-file)")
    return check_strength(token, "the internal token")


def bearer_principal(header: str | None, tokens: dict[str, str]) -> str | None:
    """The name of the token an `Authorization: Bearer ...` header carries ({token: name}), or None;
    every token is compared in constant time, so the time does not tell which one came close."""
    if not header or not header.startswith("Bearer "):
        return None
    sent, found = header[7:].encode(), None
    for token, name in tokens.items():
        if hmac.compare_digest(sent, token.encode()):
            found = name
    return found


def frame_key(token: str) -> bytes:
    """The HMAC key of side-channel and data-path frames (never the token itself on the wire)."""
    return hmac.new(token.encode(), b"pdserve frame key v1", hashlib.sha256).digest()


CHALLENGE_HEADER = "x-pdserve-challenge"
PROOF_HEADER = "x-pdserve-proof"
MAX_NONCE_CHARS = 128


def token_proof(token: str, nonce: str, host: str) -> str:
    """An instance's answer to the router's challenge: a MAC over the nonce and the Host it was
    addressed as, under a key derived from the token (the token itself never goes out)."""
    key = hmac.new(token.encode(), b"pdserve instance proof v1", hashlib.sha256).digest()
    return sign(key, nonce.encode(), host.lower().encode()).hex()


def sign(key: bytes, *parts: bytes) -> bytes:
    """MAC over the parts (length-prefixed, so moving bytes between parts changes it)."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        mac.update(len(p).to_bytes(8, "little"))
        mac.update(p)
    return mac.digest()


def verify(key: bytes, tag: bytes, *parts: bytes) -> bool:
    return isinstance(tag, bytes) and len(tag) == MAC_BYTES and hmac.compare_digest(tag, sign(key, *parts))
