"""kvpush's transfer counters and latencies in vLLM's stats pipeline and on /metrics.

The worker side reports deltas keyed as in ``worker_side.COUNTERS`` ("name" or
"name:label value") and lists of seconds for ``worker_side.HISTOGRAMS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpush.vllm.worker_side import COUNTERS, HISTOGRAMS

_DOCS = {
    "bytes_sent": "KV bytes this prefiller pushed into decoders (kvpush)",
    "bytes_received": "KV bytes prefillers pushed into this decoder (kvpush)",
    "pushes_sent": "Requests whose KV this prefiller pushed, by path: copy or nixl (kvpush)",
    "pushes_received": "Requests whose KV arrived here by push (kvpush)",
    "write_descriptors": "NIXL descriptors this prefiller's WRITEs posted (kvpush)",
    "push_failures": "Failed pushes and receives, by cause (kvpush)",
    "early_hand_overs": "Requests this prefiller pushed at the end of their forward (kvpush)",
    "layer_writes": "WRITEs of one layer's blocks, for prompts pushed layer by layer (kvpush)",
    "layers_unreported": "Layers a forward did not report, pushed at its end instead (kvpush)",
    "withdrawals": "Requests aborted on D before they registered: D sent / P freed (kvpush)",
    "late_write_holds": "Receives failed by the watchdog whose blocks stayed held (kvpush)",
    "late_completions_held": "Completions that reached held blocks: late WRITEs (kvpush)",
    "illegal_transitions": "Transfers moved where their state table forbids: a bug (kvpush)",
}
_LABEL = {"pushes_sent": "path", "push_failures": "cause"}
_HIST_DOCS = {
    "push_seconds": "Prefiller: from a request's blocks handed over to its push done (kvpush)",
    "kv_wait_seconds": "Decoder: from its registration sent to the KV in its blocks (kvpush)",
}
_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


@dataclass
class KVPushStats(KVConnectorStats):  # type: ignore[misc]
    """Counter deltas (summed) and latency lists (joined)."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVPushStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            if isinstance(value, list):
                merged[key] = [*merged.get(key, []), *value]
            else:
                merged[key] = merged.get(key, 0) + value
        return KVPushStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key in COUNTERS:
            name = key.split(":", 1)[0]
            out[name] = out.get(name, 0) + self.data.get(key, 0)
        for key in HISTOGRAMS:
            got = self.data.get(key) or []
            if got:
                out[f"{key}_avg"] = sum(got) / len(got)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {
            name: self._counter_cls(
                name=f"vllm:kvpush_{name}",
                documentation=doc,
                labelnames=[*labelnames, *([_LABEL[name]] if name in _LABEL else [])],
            )
            for name, doc in _DOCS.items()
        }
        hist: Any = self._histogram_cls
        self._hists: dict[str, Any] = {
            name: hist(
                name=f"vllm:kvpush_{name}",
                documentation=doc,
                labelnames=labelnames,
                buckets=_BUCKETS,
            )
            for name, doc in _HIST_DOCS.items()
        }
        self._children: dict[tuple[str, int], Any] = {}
        # Every series exists from the start (at 0), so a scrape sees them all.
        for engine in per_engine_labelvalues:
            for key in COUNTERS:
                self._child(key, engine)

    def _child(self, key: str, engine: int) -> Any:
        child = self._children.get((key, engine))
        if child is None:
            name, _, label = key.partition(":")
            values = list(self.per_engine_labelvalues[engine])
            family = self._families[name] if name in _DOCS else self._hists[name]
            child = family.labels(*values, *([label] if label else []))
            self._children[(key, engine)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in HISTOGRAMS:
                child = self._child(key, engine_idx)
                for seconds in value:
                    child.observe(seconds)
            elif key in COUNTERS and value:
                self._child(key, engine_idx).inc(value)
