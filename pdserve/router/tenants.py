"""Clients' API keys and the prefix-cache namespace of each request (torch-free).

Principals: `--api-key KEY` is one key named "default"; `--api-key-file PATH` holds one `name:key`
a line (`#` comments and blank lines ignored). The authenticated principal of a request is its
key's name (serving/http_edge.py `RequireBearer` puts it in the ASGI scope, PRINCIPAL_SCOPE_KEY).

Cache namespace (docs/security.md "Prefix cache and tenants"): the router, never the request
body, decides it: the principal's name, narrowed by the trusted `--namespace-header` (a gateway's
tenant, honoured only when that flag names it) and by the request's own `cache_salt`. A narrowing
part is hashed together with the principal, so it can split a principal's namespace but never
reach another's. No API key, no header, no salt: the one shared namespace "" (as before).
Instances get it as a hex digest (contracts._Sampling.cache_namespace), mixed into the root of
their radix trees; the cache_aware policy mixes it into its prefix hashes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

DEFAULT_PRINCIPAL = "default"  # the one key of --api-key
MIN_API_KEY_CHARS = 16
NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
NAMESPACE_HEX = 32  # the digest's hex characters on the wire


def parse_api_keys(text: str, source: str) -> dict[str, str]:
    """{key: name} from a key file's text; ValueError naming the line for anything malformed."""
    keys: dict[str, str] = {}
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, key = line.partition(":")
        name, key = name.strip(), key.strip()
        where = f"{source} line {number}"
        if not sep or not NAME.match(name):
            raise ValueError(f"{where}: expected `name:key` with a name of 1-64 letters, digits, . _ -")
        if len(key) < MIN_API_KEY_CHARS:
            raise ValueError(f"{where}: the key of {name!r} is shorter than {MIN_API_KEY_CHARS} characters")
        if name in names:
            raise ValueError(f"{where}: the name {name!r} is listed twice")
        if key in keys:
            raise ValueError(f"{where}: the key of {name!r} is also {keys[key]!r}'s")
        keys[key] = name
        names.add(name)
    if not keys:
        raise ValueError(f"{source} holds no `name:key` line")
    return keys


def load_api_keys(api_key: str | None, api_key_file: str | None) -> dict[str, str] | None:
    """{key: principal name} of --api-key and --api-key-file together; None: the API is open."""
    keys: dict[str, str] = {}
    if api_key_file is not None:
        try:
            text = Path(api_key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --api-key-file {api_key_file}: {e}") from None
        keys = parse_api_keys(text, f"--api-key-file {api_key_file}")
    if api_key is not None:
        if len(api_key) < MIN_API_KEY_CHARS or len(set(api_key)) < 8:
            raise ValueError(
                f"--api-key is too weak: use at least {MIN_API_KEY_CHARS} random characters "
                "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(24))'`)"
            )
        if api_key in keys:
            raise ValueError(f"--api-key is also {keys[api_key]!r}'s key in --api-key-file")
        if DEFAULT_PRINCIPAL in keys.values():
            raise ValueError(
                f"--api-key is named {DEFAULT_PRINCIPAL!r}: --api-key-file must not use that name"
            )
        keys[api_key] = DEFAULT_PRINCIPAL
    return keys or None


def cache_namespace(principal: str | None, header: str | None = None, salt: str | None = None) -> str:
    """The instances' namespace of a request: "" (shared) with no principal, header nor salt, else a
    hex digest of the length-prefixed parts (no two different part lists give the same input)."""
    parts = [principal or "", header or "", salt or ""]
    if not any(parts):
        return ""
    h = hashlib.blake2b(b"pdserve cache namespace v1", digest_size=NAMESPACE_HEX // 2)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()
