"""Prometheus metrics of the router, written by hand in the text exposition format (version 0.0.4).

Histograms: time to first token, inter-token latency, end-to-end latency, prefill answer time
(prefill request sent -> cache shipped). Counters: requests by outcome, retries by the role that
failed. Gauges come from the pool's last poll at scrape time: health, queue depth, free, cached and
total KV tokens, in-flight and served requests, completed and failed KV hand-offs per instance, and
the prefix caches' hit tokens and the hand-off bytes they kept off the wire; with `cache_aware`, the
prefix tokens its choices expected to hit.
"""

from __future__ import annotations

import math

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
OUTCOMES = ("completed", "client_error", "unavailable", "failed", "aborted", "rejected", "timeout")
REJECTIONS = ("router_queue_full", "instances_full")


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        lines += [
            f'{self.name}_bucket{{le="+Inf"}} {self.count}',
            f"{self.name}_sum {_num(self.sum)}",
            f"{self.name}_count {self.count}",
        ]
        return lines


class Metrics:
    def __init__(self):
        self.ttft = Histogram(
            "pdserve_router_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
        )
        self.itl = Histogram(
            "pdserve_router_inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of one request.",
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_latency_seconds",
            "Seconds from a request's arrival to its last token or error.",
        )
        self.prefill = Histogram(
            "pdserve_router_prefill_seconds",
            "Seconds from sending a prefill request to its answer (the KV cache shipped).",
        )
        self.requests = {o: 0 for o in OUTCOMES}
        self.retries = {"prefill": 0, "decode": 0}
        self.rejections = {r: 0 for r in REJECTIONS}
        self.tokens = 0
        self.queued = lambda: 0  # requests waiting for an instance with room (set by the app)
        self.cache_aware = None  # router/cache_aware.py's policy, when --policy cache_aware (set by the app)

    def finished(self, outcome: str) -> None:
        self.requests[outcome] += 1

    def rejected(self, reason: str) -> None:
        self.rejections[reason] += 1

    def retry(self, role: str) -> None:
        self.retries[role] += 1

    def observe_prefill(self, seconds: float) -> None:
        self.prefill.observe(seconds)

    def render(self, instances) -> str:
        lines: list[str] = []
        for h in (self.ttft, self.itl, self.e2e, self.prefill):
            lines += h.render()
        lines += [
            "# HELP pdserve_router_requests_total Requests by outcome.",
            "# TYPE pdserve_router_requests_total counter",
        ]
        lines += [f'pdserve_router_requests_total{{outcome="{o}"}} {n}' for o, n in self.requests.items()]
        lines += [
            "# HELP pdserve_router_retries_total Failed tries that were retried, by the role that failed.",
            "# TYPE pdserve_router_retries_total counter",
        ]
        lines += [f'pdserve_router_retries_total{{role="{r}"}} {n}' for r, n in self.retries.items()]
        lines += [
            "# HELP pdserve_router_rejected_total Requests refused with 429, by reason.",
            "# TYPE pdserve_router_rejected_total counter",
        ]
        lines += [f'pdserve_router_rejected_total{{reason="{r}"}} {n}' for r, n in self.rejections.items()]
        lines += [
            "# HELP pdserve_router_queued_requests Requests waiting for an instance with room.",
            "# TYPE pdserve_router_queued_requests gauge",
            f"pdserve_router_queued_requests {self.queued()}",
        ]
        lines += [
            "# HELP pdserve_router_generated_tokens_total Tokens streamed to clients.",
            "# TYPE pdserve_router_generated_tokens_total counter",
            f"pdserve_router_generated_tokens_total {self.tokens}",
        ]
        if self.cache_aware is not None:
            lines += [
                "# HELP pdserve_router_prefix_match_tokens_total Prompt tokens cache_aware expected the chosen instances' prefix caches to hold.",
                "# TYPE pdserve_router_prefix_match_tokens_total counter",
                f"pdserve_router_prefix_match_tokens_total {self.cache_aware.match_tokens}",
                "# HELP pdserve_router_cache_aware_balanced_total Choices where the best match was overloaded and least_load chose.",
                "# TYPE pdserve_router_cache_aware_balanced_total counter",
                f"pdserve_router_cache_aware_balanced_total {self.cache_aware.balanced}",
            ]
        lines += _instance_gauges(list(instances))
        return "\n".join(lines) + "\n"


def _instance_gauges(instances) -> list[str]:
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
    lines = []
    for name, help_, value in gauges:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        for inst in instances:
            v = value(inst)
            if v is not None:
                lines.append(f'{name}{{instance="{_label(inst.url)}",role="{inst.role}"}} {_num(v)}')
    return lines


def _num(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
