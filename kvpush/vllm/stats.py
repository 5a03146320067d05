"""kvpush's transfer counters in vLLM's stats pipeline and on its /metrics page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvpush.vllm.worker_side import STAT_KEYS

_DOCS = {
    "bytes_sent": "KV bytes this prefiller pushed into decoders (kvpush)",
    "bytes_received": "KV bytes prefillers pushed into this decoder (kvpush)",
    "pushes_sent": "Requests whose KV this prefiller pushed (kvpush)",
    "pushes_received": "Requests whose KV arrived here by push (kvpush)",
    "push_failures": "Failed kvpush WRITEs and handshakes",
    "early_hand_overs": "Requests this prefiller pushed at the end of their forward (kvpush)",
}


@dataclass
class KVPushStats(KVConnectorStats):  # type: ignore[misc]
    """Counter deltas: aggregated by summing."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVPushStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KVPushStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPushPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, Any] = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvpush_{key}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for key, doc in _DOCS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if key in self.counters and value:
                self.counters[key][engine_idx].inc(value)
