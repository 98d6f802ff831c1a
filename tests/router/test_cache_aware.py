"""The router's `cache_aware` policy without servers (router/cache_aware.py, pool.py): a prompt goes to
the instance whose prefix cache is expected to hold its longest prefix, unless that instance is
overloaded (balance threshold), else least_load; the model of each instance is bounded by its
capacity and forgets what the instance reports it evicted, or what grew too old."""

from __future__ import annotations

from pdserve.contracts import DecodeCapacity, PrefillInfo
from pdserve.router.cache_aware import BLOCK, CacheAwarePolicy, PrefixModel, prefix_hashes
from pdserve.router.metrics import Metrics
from pdserve.router.pool import Pool
from tests.router.helpers import metric

SYSTEM = list(range(1000, 1000 + 4 * BLOCK))  # a 4-block shared system prompt


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def cache_pool(threshold: int = 2) -> Pool:
    pool = Pool(
        ("http://p1", "http://p2"), ("http://d1", "http://d2"), "cache_aware", balance_threshold=threshold
    )
    for inst in pool.instances.values():
        inst.healthy = True
        inst.info = (
            PrefillInfo(bootstrap="tcp://h:1", total_tokens=4096, queued=0, evicted_tokens=0)
            if inst.role == "prefill"
            else DecodeCapacity(total_tokens=4096, free_tokens=4096, queued=0, evicted_tokens=0)
        )
    return pool


def convo(i: int, turns: int) -> list[int]:
    """Conversation i after `turns` turns: the system prompt, then 2 blocks per turn."""
    return SYSTEM + [
        t for k in range(turns) for t in range(i * 10_000 + k * 100, i * 10_000 + k * 100 + 2 * BLOCK)
    ]


def test_prefix_hashes_name_whole_prefixes():
    a, b = prefix_hashes(SYSTEM + [1] * 20), prefix_hashes(SYSTEM + [2] * 20)
    assert len(a) == 5 and a[:4] == b[:4] and a[4] != b[4]  # 20 tokens: one more whole block
    assert (
        prefix_hashes([7] * BLOCK + SYSTEM)[1] != prefix_hashes(SYSTEM)[0]
    )  # a block is named by its prefix
    assert prefix_hashes(list(range(BLOCK - 1))) == []


def test_conversations_stick_to_their_instances_and_spread_by_load():
    pool = cache_pool()
    first = {}
    for i in range(4):  # new conversations: nothing matches beyond the system prompt -> balance by load
        prompt = convo(i, 1)
        p = pool.pick("prefill", len(prompt), prompt=prompt)
        p.in_flight += 1  # the request runs there
        first[i] = p.url
    assert set(first.values()) == {"http://p1", "http://p2"}
    for inst in pool.instances.values():
        inst.in_flight = 0
    for i in range(4):  # the next turn extends the conversation: the same instance, whatever the load
        prompt = convo(i, 2)
        assert pool.pick("prefill", len(prompt), prompt=prompt).url == first[i]
    assert pool.cache_aware.match_tokens >= 4 * len(convo(0, 1))


def test_an_overloaded_best_match_loses_to_least_load():
    pool = cache_pool(threshold=2)
    prompt = convo(0, 1)
    best = pool.pick("decode", len(prompt) + 16, prompt=prompt)
    other = next(i for i in pool.of("decode") if i is not best)
    best.in_flight = 2  # within the threshold: still the match
    assert pool.pick("decode", len(prompt) + 16, prompt=convo(0, 2)) is best
    best.in_flight = 3
    assert pool.pick("decode", len(prompt) + 16, prompt=convo(0, 3)) is other
    assert pool.cache_aware.balanced == 1
    text = Metrics()
    text.cache_aware = pool.cache_aware
    text.instances = lambda: list(pool.instances.values())
    assert metric(text.render(), "pdserve_router_cache_aware_balanced_total") == 1


def test_model_bound_evictions_age_and_restart():
    clock = Clock()
    m = PrefixModel(clock, max_age_s=100)
    h = prefix_hashes(convo(0, 2))  # 8 blocks
    m.add(h)
    assert m.match(h) == 8 and m.match(prefix_hashes(convo(1, 2))) == 4
    m.observe(total_tokens=6 * BLOCK, evicted_tokens=0)  # capacity 6 blocks: the oldest 2 go
    assert m.match(h) == 0 and len(m.entries) == 6
    m.add(h)
    m.observe(6 * BLOCK, evicted_tokens=BLOCK + 1)  # the instance evicted 2 blocks' worth
    assert len(m.entries) == 4
    m.observe(6 * BLOCK, evicted_tokens=0)  # the counter went back: a restarted instance
    assert not m.entries
    m.observe(6 * BLOCK, 0, enabled=False)  # an instance with --prefix-cache off never matches
    m.add(h)
    assert not m.entries
    m.observe(6 * BLOCK, 0, enabled=True)
    m.add(h[:2])
    clock.t = 101.0
    m.add(h[2:3])
    assert m.match(h) == 0 and len(m.entries) == 1  # the first two aged out


def test_pool_forgets_a_removed_instance_and_polls_feed_the_model():
    pool = cache_pool()
    prompt = convo(0, 1)
    inst = pool.pick("prefill", len(prompt), prompt=prompt)
    assert pool.cache_aware.model(inst.url).match(prefix_hashes(prompt)) == 6
    pool.remove(inst.url)
    assert inst.url not in pool.cache_aware.models
    policy = CacheAwarePolicy()
    assert policy.choose([inst], [], lambda i: 0, lambda i: 0) is inst  # no whole block: least_load


def test_hashes_differ_across_namespaces_and_routing_never_follows_another_namespace():
    """A probe in namespace B is routed as if nothing were cached, never toward the instance that
    holds namespace A's copy of the same prompt (issue 40 item 4)."""
    a_ns, b_ns = "a" * 32, "b" * 32
    ha, hb, h0 = (prefix_hashes(SYSTEM, namespace=ns) for ns in (a_ns, b_ns, ""))
    assert len(ha) == len(hb) == len(h0) == 4
    assert not set(ha) & set(hb) and not set(ha) & set(h0) and h0 == prefix_hashes(SYSTEM)
    pool = cache_pool()
    victim = pool.pick("prefill", len(SYSTEM), prompt=SYSTEM, namespace=a_ns)
    other = next(i for i in pool.of("prefill") if i is not victim)
    victim.in_flight = 1  # least_load's choice (a miss's) is now the other one; a hit still wins
    assert pool.pick("prefill", len(SYSTEM), prompt=SYSTEM, namespace=a_ns) is victim  # own hit
    assert pool.pick("prefill", len(SYSTEM), prompt=SYSTEM, namespace=b_ns) is other
    assert pool.cache_aware.model(victim.url).match(hb) == 0
