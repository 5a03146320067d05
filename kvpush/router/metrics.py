"""Router counters, rendered in the Prometheus text format.

Hand-rolled rather than prometheus_client: a handful of counters does not justify a
dependency, and the router runs on a single event loop, so no locking is needed.
"""

from __future__ import annotations

from collections import Counter, defaultdict

_PREFIX = "kvpush_router_"


def _labels(**labels: str) -> str:
    def esc(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


class RouterMetrics:
    """Requests, errors by leg and kind, in-flight requests, latency sums."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, bool]] = Counter()  # (endpoint, stream)
        self.errors: Counter[tuple[str, str]] = Counter()  # (leg, kind)
        self.alone: Counter[str] = Counter()  # requests sent to the decoder alone, by reason
        self.in_flight = 0
        self.latency_sum: defaultdict[str, float] = defaultdict(float)  # by endpoint
        self.latency_count: Counter[str] = Counter()
        self.leg_latency_sum: defaultdict[str, float] = defaultdict(float)  # by leg
        self.leg_latency_count: Counter[str] = Counter()

    def request_started(self, endpoint: str, stream: bool) -> None:
        self.requests[(endpoint, stream)] += 1
        self.in_flight += 1

    def request_finished(self, endpoint: str, seconds: float) -> None:
        self.in_flight -= 1
        self.latency_sum[endpoint] += seconds
        self.latency_count[endpoint] += 1

    def leg_finished(self, leg: str, seconds: float) -> None:
        self.leg_latency_sum[leg] += seconds
        self.leg_latency_count[leg] += 1

    def decoder_alone(self, reason: str) -> None:
        self.alone[reason] += 1

    def error(self, leg: str, kind: str) -> None:
        self.errors[(leg, kind)] += 1

    def render(self) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> str:
            full = _PREFIX + name
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            return full

        name = family("requests_total", "counter", "Client requests received.")
        for (endpoint, stream), n in sorted(self.requests.items()):
            lines.append(f"{name}{_labels(endpoint=endpoint, stream=str(stream).lower())} {n}")
        name = family("errors_total", "counter", "Failed legs by leg and kind (refused: HTTP 4xx).")
        for (leg, kind), n in sorted(self.errors.items()):
            lines.append(f"{name}{_labels(leg=leg, kind=kind)} {n}")
        name = family(
            "decoder_alone_total", "counter", "Requests served by the decoder alone, by reason."
        )
        for reason, n in sorted(self.alone.items()):
            lines.append(f"{name}{_labels(reason=reason)} {n}")
        name = family("in_flight", "gauge", "Client requests being served.")
        lines.append(f"{name} {self.in_flight}")
        name = family("request_latency_seconds", "summary", "Client request latency.")
        for endpoint in sorted(self.latency_count):
            lbl = _labels(endpoint=endpoint)
            lines.append(f"{name}_sum{lbl} {self.latency_sum[endpoint]:.6f}")
            lines.append(f"{name}_count{lbl} {self.latency_count[endpoint]}")
        name = family("leg_latency_seconds", "summary", "Upstream leg latency (completed legs).")
        for leg in sorted(self.leg_latency_count):
            lbl = _labels(leg=leg)
            lines.append(f"{name}_sum{lbl} {self.leg_latency_sum[leg]:.6f}")
            lines.append(f"{name}_count{lbl} {self.leg_latency_count[leg]}")
        return "\n".join(lines) + "\n"
