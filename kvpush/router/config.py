"""The router's configuration and the keys of what its application holds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router.metrics import RouterMetrics


@dataclass(frozen=True)
class RouterConfig:
    prefill_url: str
    decode_url: str
    timeout: float = 120.0  # per leg; for streams, the longest gap between chunks
    prefill_side_channel: tuple[str, int] | None = None
    decode_kv_extra: dict[str, Any] = field(default_factory=dict)  # e.g. for baselines


CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
SESSION = web.AppKey("session", aiohttp.ClientSession)
BACKGROUND: web.AppKey[set[asyncio.Task[Any]]] = web.AppKey("background")
LIMITS: web.AppKey[dict[str, float | None]] = web.AppKey("limits")  # learnt from D
