"""What the producer and the consumer take from their worker: the services they share,
not the worker itself (nor the engine API)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvpush.core import wire
from kvpush.core.layout import KVLayout
from kvpush.core.peers import PeerTable
from kvpush.core.types import WorkerConfig


@dataclass
class Shared:
    config: WorkerConfig
    layout: KVLayout  # ours
    stats: Counter[str]
    peers: PeerTable
    notify: Callable[[str, wire.Message], bool]  # (agent, message): False if it failed
    emit: Callable[..., None]  # (kind, request id[, reason[, blocks]]): for get_finished
    observe: Callable[[str, float], None]  # (name, seconds): one latency
