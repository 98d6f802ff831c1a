"""Prometheus metrics of the router, kept and rendered by prometheus-client (text format 0.0.4).

Histograms: time to first token, inter-token latency, end-to-end latency, prefill answer time
(prefill request sent -> cache shipped). Counters: requests by outcome, retries by the role that
failed, refusals by reason, migrations by cause (orchestrator.py, migration.py), generated tokens. Gauges come from the pool's last poll at scrape time
(a collector of this module): health, queue depth, free, cached and total KV tokens, in-flight and
served requests, completed and failed KV hand-offs per instance, and the prefix caches' hit tokens
and the hand-off bytes they kept off the wire; with `cache_aware`, the prefix tokens its choices
expected to hit. Every Metrics has a registry of its own (a process may run several routers, e.g.
in tests), and no `_created` series: they would only repeat the router's start time.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .migration import CAUSES

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
OUTCOMES = ("completed", "client_error", "unavailable", "failed", "aborted", "rejected", "timeout")
REJECTIONS = ("router_queue_full", "instances_full")
ROLES = ("prefill", "decode")

prometheus_client.disable_created_metrics()


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()

        def histogram(name: str, help_: str) -> Histogram:
            return Histogram(name, help_, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
        )
        self.itl = histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request.",
        )
        self.e2e = histogram(
            "pdserve_router_e2e_latency_seconds",
            "Seconds from a request's arrival to its last token or error.",
        )
        self.prefill = histogram(
            "pdserve_router_prefill_seconds",
            "Seconds from sending a prefill request to its answer (the KV cache shipped).",
        )
        self.requests = Counter("pdserve_router_requests", "Requests by outcome.", ["outcome"], registry=r)
        self.retries = Counter(
            "pdserve_router_retries",
            "Failed tries that were retried, by the role that failed.",
            ["role"],
            registry=r,
        )
        self.rejections = Counter(
            "pdserve_router_rejected", "Requests refused with 429, by reason.", ["reason"], registry=r
        )
        self.migrations = Counter(
            "pdserve_router_migrations",
            "Requests moved to another instance pair after tokens were sent, by what their decode "
            "instance did: stream_broken (its stream broke or was malformed), health (it failed its "
            "health check while silent), lost (it answered that it lost the request).",
            ["cause"],
            registry=r,
        )
        for counter, values in (
            (self.requests, OUTCOMES),
            (self.retries, ROLES),
            (self.rejections, REJECTIONS),
            (self.migrations, CAUSES),
        ):
            for v in values:
                counter.labels(v)  # every label value is exposed from the start, at 0
        self.tokens = Counter("pdserve_router_generated_tokens", "Tokens streamed to clients.", registry=r)
        self.queued = lambda: 0  # requests waiting for an instance with room (set by the app)
        self.cache_aware = None  # router/cache_aware.py's policy, when --policy cache_aware (set by the app)
        self.instances = lambda: ()  # the pool's instances, read at scrape time (set by the app)
        r.register(_ScrapeTime(self))

    def finished(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def retry(self, role: str) -> None:
        self.retries.labels(role).inc()

    def migrated(self, cause: str) -> None:
        self.migrations.labels(cause).inc()

    def token(self) -> None:
        self.tokens.inc()

    def observe_prefill(self, seconds: float) -> None:
        self.prefill.observe(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _ScrapeTime:
    """The values read at scrape time: the router's queue, cache_aware's counts, the instances' gauges."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def describe(self):
        return []  # nothing known before a scrape (and no collect() at registration)

    def collect(self):
        m = self.m
        yield GaugeMetricFamily(
            "pdserve_router_queued_requests", "Requests waiting for an instance with room.", value=m.queued()
        )
        if m.cache_aware is not None:
            yield CounterMetricFamily(
                "pdserve_router_prefix_match_tokens",
                "Prompt tokens cache_aware expected the chosen instances' prefix caches to hold.",
                value=m.cache_aware.match_tokens,
            )
            yield CounterMetricFamily(
                "pdserve_router_cache_aware_balanced",
                "Choices where the best match was overloaded and least_load chose.",
                value=m.cache_aware.balanced,
            )
        yield from _instance_gauges(list(m.instances()))


def _instance_gauges(instances):
    gauges = (
        (
            "pdserve_instance_healthy",
            "1 if the instance's last health check passed.",
            lambda i: int(i.healthy),
        ),
        (
            "pdserve_instance_draining",
            "1 while the instance takes no new requests.",
            lambda i: int(i.draining),
        ),
        (
            "pdserve_instance_in_flight",
            "Requests this router has running on the instance.",
            lambda i: i.in_flight,
        ),
        (
            "pdserve_instance_served",
            "Requests that finished on the instance (a counter; resets if re-added).",
            lambda i: i.served,
        ),
        (
            "pdserve_instance_queue_depth",
            "Requests waiting in the instance (prefill queue; decode queued).",
            lambda i: i.value("queued"),
        ),
        (
            "pdserve_instance_kv_free_tokens",
            "Free KV cache tokens at the last poll.",
            lambda i: i.value("free_tokens"),
        ),
        (
            "pdserve_instance_kv_cached_tokens",
            "KV tokens in the instance's prefix cache, unreferenced (evicted on demand), at the last poll.",
            lambda i: i.value("cached_tokens"),
        ),
        (
            "pdserve_instance_prefix_hit_tokens",
            "Prompt tokens the instance's prefix cache served (its own count).",
            lambda i: i.value("prefix_hit_tokens"),
        ),
        (
            "pdserve_instance_transfer_skipped_bytes",
            "KV cache bytes hand-offs did not ship because the decode instance's prefix cache held them.",
            lambda i: i.value("transfer_skipped_bytes"),
        ),
        (
            "pdserve_instance_kv_total_tokens",
            "KV cache capacity in tokens.",
            lambda i: i.value("total_tokens"),
        ),
        (
            "pdserve_instance_transfers_completed",
            "KV hand-offs the decode instance completed (its own count).",
            lambda i: i.value("transfers_completed"),
        ),
        (
            "pdserve_instance_transfers_failed",
            "KV hand-offs the decode instance failed (its own count).",
            lambda i: i.value("transfers_failed"),
        ),
        (
            "pdserve_instance_transfer_bytes",
            "KV cache bytes the decode instance received by completed hand-offs.",
            lambda i: i.value("transfer_bytes"),
        ),
        (
            "pdserve_instance_transfer_seconds",
            "Seconds from page reservation to verified cache, summed over the "
            "decode instance's completed hand-offs.",
            lambda i: i.value("transfer_seconds"),
        ),
    )
    for name, help_, value in gauges:
        family = GaugeMetricFamily(name, help_, labels=["instance", "role"])
        for inst in instances:
            v = value(inst)
            if v is not None:
                family.add_metric([inst.url, inst.role], v)
        yield family
