"""Router metrics through prometheus_client, one registry per router application.

The names of the single-pair router are kept: `kvpush_router_requests_total`,
`errors_total`, `decoder_alone_total`, `in_flight`; `request_latency_seconds` and
`leg_latency_seconds` were summaries (sum and count only) and are histograms now (their
`_sum` and `_count` are unchanged, `_bucket` is new). Per instance: leg latency, leg
failures, and the pools' state read at scrape time (`PoolCollector`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

# `_created` series double every counter's output and nobody reads them here.
prometheus_client.disable_created_metrics()

_PREFIX = "kvpush_router_"
# Client requests and legs run from milliseconds (a refusal) to minutes (long outputs).
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    """Requests, errors by leg and kind, in-flight requests, latencies; per instance."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            _PREFIX + "requests_total",
            "Client requests received.",
            ["endpoint", "stream"],
            registry=r,
        )
        self._errors = Counter(
            _PREFIX + "errors_total",
            "Failed legs by leg and kind (refused: HTTP 4xx).",
            ["kind", "leg"],
            registry=r,
        )
        self._alone = Counter(
            _PREFIX + "decoder_alone_total",
            "Requests served by the decoder alone, by reason.",
            ["reason"],
            registry=r,
        )
        self._in_flight = Gauge(_PREFIX + "in_flight", "Client requests being served.", registry=r)
        self._latency = Histogram(
            _PREFIX + "request_latency_seconds",
            "Client request latency.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self._leg_latency = Histogram(
            _PREFIX + "leg_latency_seconds",
            "Upstream leg latency (completed legs).",
            ["leg"],
            buckets=_BUCKETS,
            registry=r,
        )
        self._instance_latency = Histogram(
            _PREFIX + "instance_leg_latency_seconds",
            "Upstream leg latency per instance (completed legs).",
            ["role", "instance"],
            buckets=_BUCKETS,
            registry=r,
        )
        self._instance_failures = Counter(
            _PREFIX + "instance_failures_total",
            "Failed legs per instance (connection, upstream 5xx, timeout; not refusals).",
            ["role", "instance", "kind"],
            registry=r,
        )
        self._retries = Counter(
            _PREFIX + "retries_total",
            "Requests sent again on another pair after a leg failed before the client "
            "got a byte, by the failed leg.",
            ["leg"],
            registry=r,
        )
        self._unavailable = Counter(
            _PREFIX + "no_instance_total",
            "Requests answered 503 because no instance of a role was available.",
            ["role"],
            registry=r,
        )
        self._first_token = Counter(
            _PREFIX + "first_token_total",
            "Streamed requests that could take P's first token (kvpush.router.head), by "
            "which leg's first token the client got (prefill or decode) and why: p_first "
            "(P answered first), d_first (D's first chunk came first), p_failed (P's leg "
            "failed), p_unusable (P's answer was not one token a plain server would send).",
            ["leg", "why"],
            registry=r,
        )
        self._refused = Counter(
            _PREFIX + "refused_total",
            "Client requests the router answered itself with a 4xx, 503 or 508, no upstream "
            "asked (busy, header, too_large, body_timeout, too_deep, loop).",
            ["reason"],
            registry=r,
        )
        self._first_mismatch = Counter(
            _PREFIX + "first_token_mismatch_total",
            "Streams where D's first token differed from P's, which the client already had "
            "(D was asked for the request again).",
            registry=r,
        )

        # Children of the per-request series, by metric and labels: `labels()` takes a
        # lock and builds a key on every call, several times per request.
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_started(self, endpoint: str, stream: bool) -> None:
        self._child(self._requests, endpoint, "true" if stream else "false").inc()
        self._in_flight.inc()

    def request_finished(self, endpoint: str, seconds: float) -> None:
        self._in_flight.dec()
        self._child(self._latency, endpoint).observe(seconds)

    def leg_finished(self, leg: str, seconds: float, instance: str = "") -> None:
        self._child(self._leg_latency, leg).observe(seconds)
        if instance:
            self._child(self._instance_latency, leg, instance).observe(seconds)

    def decoder_alone(self, reason: str) -> None:
        self._alone.labels(reason).inc()

    def error(self, leg: str, kind: str) -> None:
        self._errors.labels(kind, leg).inc()

    def instance_failed(self, role: str, instance: str, kind: str) -> None:
        self._instance_failures.labels(role, instance, kind).inc()

    def retried(self, leg: str) -> None:
        self._retries.labels(leg).inc()

    def unavailable(self, role: str) -> None:
        self._unavailable.labels(role).inc()

    def refused(self, reason: str) -> None:
        self._child(self._refused, reason).inc()

    def first_token(self, leg: str, why: str) -> None:
        self._child(self._first_token, leg, why).inc()

    def first_token_mismatch(self) -> None:
        self._first_mismatch.inc()

    def watch(self, describe: Callable[[], list[dict[str, Any]]]) -> None:
        """Report the pools' state, as `describe()` gives it, at every scrape."""
        self.registry.register(PoolCollector(describe))

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class PoolCollector:
    """Gauges per instance, read from the pools when /metrics is scraped."""

    _GAUGES = (
        ("instance_available", "1 when the instance gets new requests.", "available"),
        ("instance_healthy", "1 when its last /health probes passed.", "healthy"),
        ("instance_draining", "1 while it is drained (no new requests).", "draining"),
        ("instance_in_flight", "The router's legs in flight on it.", "in_flight"),
        ("instance_running", "Its vllm:num_requests_running, last scrape.", "running"),
        ("instance_waiting", "Its vllm:num_requests_waiting, last scrape.", "waiting"),
        ("instance_kv_usage", "Its vllm:kv_cache_usage_perc, last scrape.", "kv_usage"),
    )

    def __init__(self, describe: Callable[[], list[dict[str, Any]]]) -> None:
        self._describe = describe

    def describe(self) -> list[Any]:
        return []  # the families depend on the pools at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        instances = self._describe()
        for name, help_text, key in self._GAUGES:
            family = GaugeMetricFamily(_PREFIX + name, help_text, labels=["role", "instance"])
            for inst in instances:
                family.add_metric([inst["role"], inst["url"]], float(inst[key]))
            yield family
        family = GaugeMetricFamily(
            _PREFIX + "instance_breaker_open",
            "1 while its circuit breaker is open, 0.5 half-open, 0 closed.",
            labels=["role", "instance"],
        )
        level = {"closed": 0.0, "half_open": 0.5, "open": 1.0}
        for inst in instances:
            family.add_metric([inst["role"], inst["url"]], level[inst["breaker"]])
        yield family
