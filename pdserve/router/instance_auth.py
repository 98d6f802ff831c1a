"""Who gets the internal token from the router (issue 40 item 5; docs/security.md "Router ->
instance calls").

- `InstanceAuth` (the router's httpx client's auth) adds `Authorization: Bearer <internal token>`
  only to requests for an origin (scheme, host, port) that proved it holds the token, and never to
  a challenge. The proof: the health poll sends `X-PDServe-Challenge: <random nonce>` without the
  token, and the instance answers `X-PDServe-Proof: token_proof(token, nonce, Host)`
  (serving/auth.py; the instances' AnswerChallenge middleware). Every poll proves it again; an origin
  that stops proving is revoked at once.
- `AllowedHosts`: the hosts `/admin/add` may register, checked before anything is sent to them:
  the hosts of --prefill / --decode, those Kubernetes discovery found, and --allowed-instance-hosts
  (host names, IP addresses, CIDR networks, or * for any). Names are compared as written, never
  resolved.
"""

from __future__ import annotations

import ipaddress
import secrets

import httpx

from ..serving.auth import CHALLENGE_HEADER, PROOF_HEADER, token_proof


class Unproven(RuntimeError):
    """An instance answered without a valid proof that it holds the internal token."""


MAX_URL_CHARS = 2048


def instance_url(url: str) -> str:
    """An instance's base URL without its trailing slash; ValueError unless it is an http(s) URL with
    a host and a port in 1..65535 (what a client can connect to), of at most MAX_URL_CHARS."""
    url = url.rstrip("/")
    if len(url) > MAX_URL_CHARS:
        raise ValueError(f"instance URL longer than {MAX_URL_CHARS} characters")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"instance URL must start with http:// or https://, got {url!r}")
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"invalid instance URL {url!r}: {e}") from None
    if not u.host or (u.port is not None and not 0 < u.port < 65536):
        raise ValueError(f"instance URL {url!r} needs a host and a port in 1..65535")
    return url


def origin(url) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL; an IP address in its one spelling."""
    u = httpx.URL(str(url))
    try:
        host = str(ipaddress.ip_address(u.host))
    except ValueError:
        host = u.host.lower()
    return u.scheme, host, u.port or {"http": 80, "https": 443}.get(u.scheme)


class InstanceAuth(httpx.Auth):
    def __init__(self, token: str):
        self.token = token
        self.proven: set[tuple] = set()

    def auth_flow(self, request: httpx.Request):
        if CHALLENGE_HEADER not in request.headers and origin(request.url) in self.proven:
            request.headers["Authorization"] = f"Bearer {self.token}"
        yield request

    def challenge(self) -> dict[str, str]:
        return {CHALLENGE_HEADER: secrets.token_hex(16)}

    def check(self, url: str, resp: httpx.Response) -> None:
        """After a challenged request to `url`: trust its origin, or revoke it and raise Unproven."""
        nonce, host = resp.request.headers[CHALLENGE_HEADER], resp.request.headers.get("host", "")
        given = resp.headers.get(PROOF_HEADER, "")
        if not secrets.compare_digest(given.encode(), token_proof(self.token, nonce, host).encode()):
            self.revoke(url)
            raise Unproven(
                f"{url} did not prove that it holds the internal token ({'a wrong' if given else 'no'} "
                f"{PROOF_HEADER} on /health); the router sends it nothing with the token"
            )
        self.proven.add(origin(url))

    def revoke(self, url: str) -> None:
        self.proven.discard(origin(url))


class AllowedHosts:
    def __init__(self, entries: tuple[str, ...] = ()):
        self.any = "*" in entries
        self.nets = [ipaddress.ip_network(e.strip("[]"), strict=False) for e in entries if _is_net(e)]
        self.names = {e.lower() for e in entries if e != "*" and not _is_net(e)}

    def learn(self, url: str) -> None:
        """A host the operator or the discovery named: /admin/add may register it too."""
        self.names.add(origin(url)[1])

    def check(self, url: str) -> None:
        """ValueError naming the host unless /admin/add may register `url`."""
        host = origin(url)[1]
        if self.any or host in self.names:
            return
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None and any(ip in net for net in self.nets):
            return
        raise ValueError(
            f"host {host!r} is not an allowed instance host (the hosts of --prefill / --decode, "
            "discovered pods', and --allowed-instance-hosts)"
        )


def _is_net(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return False
    return True


def check_entries(entries: tuple[str, ...]) -> None:
    """Startup: each entry a host name, an IP address, a CIDR network or *."""
    for e in entries:
        if e != "*" and not _is_net(e) and (not e or any(c in e for c in "/:[] @")):
            raise ValueError(f"--allowed-instance-hosts: {e!r} is not a host name, IP address, network or *")
