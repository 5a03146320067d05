"""The router's configuration and the keys of what its application holds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.core import seal
from kvpush.core.secret import Secret
from kvpush.router import wire
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import InstanceSpec, Policy, Pool


@dataclass(frozen=True)
class RouterConfig:
    # One pair: prefill_url / decode_url (and prefill_side_channel for that prefiller);
    # pools: `instances`, and/or `config_path` (a JSON file, re-read when it changes or on
    # SIGHUP). All of them together make the pools.
    prefill_url: str = ""
    decode_url: str = ""
    timeout: float = 120.0  # per leg; for streams, the longest gap between chunks
    prefill_side_channel: tuple[str, int] | None = None
    decode_kv_extra: dict[str, Any] = field(default_factory=dict)  # e.g. for baselines
    instances: tuple[InstanceSpec, ...] = ()
    config_path: str | None = None
    policy: Policy = field(default_factory=Policy)
    health_interval: float = 1.0  # seconds between /health probes of each instance
    health_timeout: float = 5.0  # a slower answer counts as a failed probe
    health_fails: int = 2  # failed probes in a row that take an instance out
    health_passes: int = 2  # passed probes in a row that bring it back
    scrape_interval: float = 1.0  # seconds between /metrics scrapes of each instance
    retries: int = 1  # more attempts on another pair, before the client got a byte
    admin_token: str | None = None  # required as "Bearer <token>" by /admin/* when set
    # Without a token the admin endpoints are off, unless this opens them to loopback
    # clients (an explicit choice: a browser on this host is such a client too).
    admin_loopback_open: bool = False
    max_concurrent: int = 1024  # client requests at once; beyond, 503 with Retry-After
    max_body_bytes: int = 64 * 1024 * 1024  # a longer request body gets 413
    body_timeout: float = 30.0  # seconds to receive a request's body; slower: 408
    # Seals every leg's kv_transfer_params (kvpush.core.seal); from KVPUSH_PARAMS_SECRET.
    params_secret: Secret | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        positive = {
            "timeout": self.timeout,
            "health_interval": self.health_interval,
            "health_timeout": self.health_timeout,
            "scrape_interval": self.scrape_interval,
            "breaker_cooldown": self.policy.breaker_cooldown,
            "body_timeout": self.body_timeout,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        counts = {
            "health_fails": self.health_fails,
            "health_passes": self.health_passes,
            "breaker_failures": self.policy.breaker_failures,
            "max_concurrent": self.max_concurrent,
            "max_body_bytes": self.max_body_bytes,
        }
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.retries < 0 or self.policy.affinity_chars < 0:
            raise ValueError("retries and affinity_chars must be >= 0")
        if self.params_secret is not None and not seal.flat(self.decode_kv_extra):
            raise ValueError("decode_kv_extra must be flat scalars to be sealed")
        token = self.admin_token
        if token is not None and not (token.isascii() and token.isprintable() and token.strip()):
            raise ValueError("admin_token must be printable ASCII, not empty (an HTTP header)")

    def specs(self) -> list[InstanceSpec]:
        """The instances given directly (not by the config file)."""
        out = list(self.instances)
        if self.prefill_url:
            out.insert(0, InstanceSpec("prefill", self.prefill_url, self.prefill_side_channel))
        if self.decode_url:
            out.insert(1 if self.prefill_url else 0, InstanceSpec("decode", self.decode_url))
        return out


CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
SESSION = web.AppKey("session", aiohttp.ClientSession)  # probes, scrapes, /v1/models
UPSTREAMS = web.AppKey("upstreams", wire.Upstreams)  # the legs of client requests
POOL = web.AppKey("pool", Pool)
BACKGROUND: web.AppKey[set[asyncio.Task[Any]]] = web.AppKey("background")
LIMITS: web.AppKey[dict[str, float | None]] = web.AppKey("limits")  # learnt from D
