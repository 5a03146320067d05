"""One client request as the router carries it from its read to its answer (`Call`)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvpush.router import legs, wire
from kvpush.router.config import CONFIG, METRICS, POOL, UPSTREAMS, RouterConfig
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Instance, Pool

# What an attempt ends with; a LegError: it failed before the client got a byte.
Outcome = web.StreamResponse | legs.LegError


def new_tid() -> str:
    return uuid.uuid4().hex


@dataclass
class Call:
    """A client request, made once by `app._proxy` and handed to every step after it.

    The first fields hold for the whole request; the last ones are those of the attempt
    under way (a retry chooses another pair and issues another transfer id)."""

    request: web.Request
    path: str  # the upstream path: the client's
    chat: bool
    endpoint: str  # the metrics' label
    raw: bytes  # the body as the client sent it
    body: Any  # as parsed, less the client's kv_transfer_params (`bodies.untrusted`)
    stream: bool
    tid: str  # the transfer id, also each leg's X-Request-Id
    # What each leg sends besides its body. Replaced, never changed, on a retry: a leg
    # still running keeps the headers it started with.
    headers: dict[str, str]
    started: float = 0.0  # time.monotonic() when the request was counted in
    attempt: int = 0
    p: Instance | None = None
    d: Instance | None = None
    retry_ok: bool = False  # another decoder is left should this attempt fail
    early: bool = False  # P's first token may go to the client (`head.eligible`)
    prefill_task: asyncio.Task[legs.LegResult] | None = field(default=None, repr=False)

    @property
    def app(self) -> web.Application:
        return self.request.app

    @property
    def cfg(self) -> RouterConfig:
        return self.app[CONFIG]

    @property
    def metrics(self) -> RouterMetrics:
        return self.app[METRICS]

    @property
    def pool(self) -> Pool:
        return self.app[POOL]

    @property
    def upstreams(self) -> wire.Upstreams:
        return self.app[UPSTREAMS]

    @property
    def timeout(self) -> float:
        """Each leg's bound (for a stream: the longest gap between its pieces)."""
        return self.cfg.timeout

    @property
    def pair(self) -> tuple[Instance, Instance]:
        assert self.p is not None and self.d is not None, "no pair chosen yet"
        return self.p, self.d

    @property
    def prefill(self) -> asyncio.Task[legs.LegResult]:
        assert self.prefill_task is not None, "the prefill leg has not started"
        return self.prefill_task

    def new_transfer(self) -> None:
        """A retry's own transfer id (P and D match their legs by it)."""
        self.tid = new_tid()
        self.headers = {**self.headers, "X-Request-Id": self.tid}
