"""The router's view of its instances: topology, health, load, and the choice of a pair.

An `Instance` is one prefill or decode server, known by its base URL. The health loop polls every
instance's /health and its load endpoint (prefill /info, decode /capacity: contracts.py) and keeps
the last answer, parsed (an answer that is not the contract's fails the poll); a failed poll, or a failed request (`suspect`), marks it unhealthy until a poll succeeds.
A draining instance gets no new requests; its running ones finish. Choosing never blocks: it reads
only the last polled state plus the router's own in-flight counts. An instance with
`max_in_flight` requests of this router running is full (`Saturated`); `released()` wakes the
requests that wait for room (orchestrator.py bounds how many may wait).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import httpx

from ..contracts import LOAD_PATHS, LoadAnswer
from ..kvcache.kv_fit import Need
from .cache_aware import CacheAwarePolicy, prefix_hashes
from .instance_auth import AllowedHosts, InstanceAuth, instance_url, origin

ROLES = ("prefill", "decode")


class NoInstance(Exception):
    """No healthy, non-draining instance of a role (503)."""


class TooLong(Exception):
    """The request can never fit any decode (or prefill) instance (400)."""


class Saturated(NoInstance):
    """Every usable instance of a role has max_in_flight requests running: wait, or 429."""


@dataclass
class Instance:
    role: str
    url: str
    healthy: bool = False  # until the first successful poll
    draining: bool = False
    stopping: bool = False  # its own /health says it drains (SIGTERM): what runs there finishes there
    error: str | None = None  # why it is unhealthy
    info: LoadAnswer | None = None  # last /info (PrefillInfo) or /capacity (DecodeCapacity) answer
    in_flight: int = 0  # requests this router has running on it
    served: int = 0  # requests that finished on it (both halves succeeded)
    last_poll: float = 0.0
    proven: bool | None = None  # proved it holds the internal token (None: not asked, or no token)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def value(self, name: str):
        """A field of the last load answer; None before the first poll or when its role has no such field."""
        return getattr(self.info, name, None)

    @property
    def bootstrap(self) -> str | None:
        return self.value("bootstrap")

    def total_tokens(self) -> int | None:
        return self.value("total_tokens")

    def load(self) -> tuple:
        """Smaller is less loaded: the router's in-flight requests, then the instance's own queue
        (then, on a decode, the most free KV tokens)."""
        queued = self.value("queued") or 0
        if self.role == "prefill":
            return (self.in_flight, queued)
        return (self.in_flight, queued, -_available(self))

    def summary(self) -> dict:
        """One topology row (the admin API's and `pdserve admin topology`'s)."""
        v = self.value
        row = {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "draining": self.draining,
            "error": self.error,
            "in_flight": self.in_flight,
            "served": self.served,
            "ranks": len(v("ranks") or []),
            "free_tokens": v("free_tokens"),
            "cached_tokens": v("cached_tokens"),  # prefix cache, unreferenced
            "in_use_tokens": v("in_use_tokens"),
            "prefix_hit_tokens": v("prefix_hit_tokens"),
            "total_tokens": v("total_tokens"),
            "queued": v("queued"),
        }
        if self.role == "prefill":  # queue_depth: the old name of queued, kept for one release
            row.update(cp_size=v("cp_size"), queue_depth=v("queued"), bootstrap=v("bootstrap"))
        else:
            row.update(
                tp_size=v("tp_size"), dcp_size=v("dcp_size"), index_mode=v("index_mode"), running=v("running")
            )
        return row


class Pool:
    """All instances of both roles, the selection policy, and the health loop."""

    def __init__(
        self,
        prefill: tuple[str, ...],
        decode: tuple[str, ...],
        policy: str,
        max_in_flight: int = 1 << 30,
        balance_threshold: int = 4,
        auth: InstanceAuth | None = None,
        allowed: AllowedHosts | None = None,
    ):
        """auth: who gets the internal token (None: the instances are open, no token is sent);
        allowed: the hosts /admin/add may register (those added here are learnt)."""
        self.instances: dict[str, Instance] = {}
        self.auth, self.allowed = auth, allowed or AllowedHosts()
        self.policy, self.max_in_flight = policy, max_in_flight
        self.cache_aware = CacheAwarePolicy(balance_threshold) if policy == "cache_aware" else None
        self.health_rounds = 0  # completed polls of every instance (health_loop)
        self._room: asyncio.Event | None = None  # set (and replaced) whenever a request leaves an instance
        self._turn = {role: itertools.count() for role in ROLES}
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                self.add(role, url)

    # topology -----------------------------------------------------------------------------
    def add(self, role: str, url: str) -> Instance:
        return self.admit(self.candidate(role, url))

    def candidate(self, role: str, url: str) -> Instance:
        """An instance that may be added (ValueError if not), not yet in the pool: /admin/add polls
        it first, so one that cannot prove the internal token is never seen by the health loop."""
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        url = instance_url(url)
        if url in self.instances:
            raise ValueError(f"{url} is already registered (as {self.instances[url].role})")
        return Instance(role, url)

    def admit(self, inst: Instance) -> Instance:
        if inst.url in self.instances:  # added while a candidate was being polled
            raise ValueError(f"{inst.url} is already registered (as {self.instances[inst.url].role})")
        self.instances[inst.url] = inst
        self.allowed.learn(inst.url)  # the operator's or the discovery's (/admin/add checks first)
        return inst

    def get(self, url: str) -> Instance:
        try:
            return self.instances[url.rstrip("/")]
        except KeyError:
            raise KeyError(f"no instance {url}") from None

    def remove(self, url: str) -> Instance:
        inst = self.get(url)
        del self.instances[inst.url]
        if self.auth is not None and all(origin(i.url) != origin(inst.url) for i in self.instances.values()):
            self.auth.revoke(inst.url)
        if self.cache_aware is not None:
            self.cache_aware.forget(inst.url)
        return inst

    def of(self, role: str) -> list[Instance]:
        return [i for i in self.instances.values() if i.role == role]

    def ready(self) -> bool:
        return all(any(i.usable for i in self.of(role)) for role in ROLES)

    # choice -------------------------------------------------------------------------------
    def pick(
        self,
        role: str,
        need: int | Need,
        avoid: set[str] = frozenset(),
        prompt: list[int] | None = None,
        namespace: str = "",
    ) -> Instance:
        """An instance of `role` for a request of `need` (a decode's: its kv_fit.Need, counted in each
        instance's pages; a prefill's: the prompt's tokens); `prompt` (its token ids) and its cache
        `namespace`: for cache_aware (router/cache_aware.py)."""
        fresh = self.candidates(role, need, avoid)
        if self.cache_aware is not None and prompt is not None:
            hashes = prefix_hashes(prompt, namespace=namespace)
            return self.cache_aware.choose(fresh, hashes, Instance.load, _busy)
        if self.policy in ("least_load", "cache_aware"):
            return min(fresh, key=Instance.load)
        return fresh[next(self._turn[role]) % len(fresh)]

    def candidates(
        self, role: str, need: int | Need, avoid: set[str] = frozenset(), admit: bool = True
    ) -> list[Instance]:
        """The instances `pick` chooses from; raises NoInstance or TooLong, and with `admit` Saturated
        when all of them are full. Does not advance round robin."""
        usable = [i for i in self.of(role) if i.usable and (role == "decode" or i.bootstrap)]
        if not usable:
            raise NoInstance(f"no healthy {role} instance")
        fits = [i for i in usable if _fits(i, need, i.total_tokens() or 0)]
        if not fits:
            most = max(i.total_tokens() or 0 for i in usable)
            if isinstance(need, Need):
                what = f"{need} needs {min(need.tokens(_page_size(i)) for i in usable)} KV tokens"
            else:
                what = f"the prompt is {need} tokens"
            raise TooLong(f"{what}, more than any {role} instance holds ({most})")
        fresh = [i for i in fits if i.url not in avoid] or fits  # another try prefers other instances
        if admit:
            fresh = [i for i in fresh if i.in_flight < self.max_in_flight]
            if not fresh:
                raise Saturated(f"every {role} instance has {self.max_in_flight} requests running")
        if role == "decode":  # prefer instances with room now; the others queue the request
            fresh = [i for i in fresh if _fits(i, need, _available(i))] or fresh
        return fresh

    def released(self) -> None:
        """A request left an instance: wake whoever waits for room."""
        if self._room is not None:
            self._room.set()
            self._room = None

    async def wait_for_room(self, timeout_s: float) -> None:
        """Returns when some request left an instance, or after timeout_s. Not asyncio.wait_for,
        which on Python 3.11 drops a cancellation that comes as the event is set (router/orchestrator.py
        next_event)."""
        if self._room is None:
            self._room = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._room.wait()
        except TimeoutError:
            pass

    # health -------------------------------------------------------------------------------
    async def poll(self, client: httpx.AsyncClient, inst: Instance) -> None:
        """One health + load check; the instance is healthy iff both answered 200."""
        path, answer = LOAD_PATHS[inst.role]
        try:
            challenge = self.auth.challenge() if self.auth is not None else None
            health = await client.get(f"{inst.url}/health", timeout=5, headers=challenge)
            if self.auth is not None:  # before anything goes out with the token
                inst.proven = False
                self.auth.check(inst.url, health)
                inst.proven = True
            if health.status_code != 200:  # an instance's own drain (SIGTERM) makes it unusable too
                inst.stopping = _says_draining(health)
                raise RuntimeError(("draining: " if inst.stopping else "") + _detail(health))
            inst.stopping = False
            load = await client.get(f"{inst.url}{path}", timeout=5)
            if load.status_code != 200:
                raise RuntimeError(f"{path}: {_detail(load)}")
            inst.info, inst.healthy, inst.error = answer.model_validate_json(load.content), True, None
            if self.cache_aware is not None:  # the instance's evictions age the router's model of it
                self.cache_aware.model(inst.url).observe(
                    inst.value("total_tokens"), inst.value("evicted_tokens"), inst.value("prefix_cache")
                )
        except (httpx.HTTPError, RuntimeError, ValueError) as e:  # Unproven is a RuntimeError
            inst.stopping = inst.stopping and isinstance(e, RuntimeError)  # unreachable: gone, not draining
            inst.healthy, inst.error = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        inst.last_poll = time.time()

    async def poll_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.poll(client, i) for i in list(self.instances.values())))

    def suspect(self, inst: Instance, reason: str) -> None:
        """A request failed on `inst`: stop choosing it until the next poll says otherwise."""
        inst.healthy, inst.error, inst.stopping = False, reason, False

    async def health_loop(self, client: httpx.AsyncClient, interval_s: float) -> None:
        while True:
            await self.poll_all(client)
            self.health_rounds += 1
            await asyncio.sleep(interval_s)


def _page_size(inst: Instance) -> int:
    return inst.value("page_size") or 1  # a prefill's, or an instance that names none: tokens


def _fits(inst: Instance, need: int | Need, capacity_tokens: int) -> bool:
    """Whether `need` fits `capacity_tokens` of `inst`: a Need by the rule the decode scheduler refuses
    by (kvcache/kv_fit.py, in the instance's own whole pages), an int (a prompt's tokens) as it is."""
    return need <= capacity_tokens if isinstance(need, int) else need.fits(_page_size(inst), capacity_tokens)


def _available(inst: Instance) -> int:
    """KV tokens a request can get now: free, plus prefix-cache pages evicted on demand."""
    return (inst.value("free_tokens") or 0) + (inst.value("cached_tokens") or 0)


def _busy(inst: Instance) -> int:
    """cache_aware's balance measure: the router's requests on it plus the instance's own queue."""
    return inst.in_flight + (inst.value("queued") or 0)


def _says_draining(resp: httpx.Response) -> bool:
    """/health of an instance that got SIGTERM: 503 {"status": "draining"} (serving/drain.py)."""
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}"
    msg = error_message(body)
    return f"HTTP {resp.status_code}: {msg}" if msg else f"HTTP {resp.status_code}"


def error_message(body) -> str | None:
    """The message of an instance's error body ({"error": {"message"}}, or an older {"detail"})."""
    if not isinstance(body, dict):
        return None
    err = body.get("error") or body.get("detail")
    if isinstance(err, dict):
        err = err.get("message") or err
    return str(err)[:500] if err else None
