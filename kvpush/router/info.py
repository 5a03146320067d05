"""The router's own endpoints: /v1/models, /health and /metrics.

Where the router asks D's ``/v1/models`` for a client (the model list, the context
length its pre-checks use), it sends the client's ``Authorization``: behind vLLM's
``--api-key`` an anonymous ask is refused, and the pre-checks would quietly stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router import admin, boundary, legs
from kvpush.router.config import CONFIG, LIMITS, METRICS, POOL, SESSION

_HEALTH_TIMEOUT_S = 5.0
_ASK_AGAIN_S = 10.0  # how soon to ask D for its max_model_len again when it could not say


def _decoder(app: web.Application) -> str | None:
    """A decoder to ask about the model: an available one, else any."""
    pool = app[POOL]
    inst = pool.choose("decode") or next(iter(pool.instances["decode"].values()), None)
    return inst.url if inst is not None else None


async def models(request: web.Request) -> web.StreamResponse:
    # Benchmark clients ask for the model name; every instance serves the same model.
    app = request.app
    headers = boundary.upstream_headers(request)
    url = _decoder(app)
    if url is None:
        err = legs.LegError("decode", "connection", "no decode instance configured")
        return web.json_response(err.to_json(""), status=503)
    try:
        async with asyncio.timeout(_HEALTH_TIMEOUT_S):
            async with app[SESSION].get(url + "/v1/models", headers=headers) as resp:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
                return web.Response(body=data, status=resp.status, headers={"Content-Type": ctype})
    except TimeoutError:
        err = legs.LegError("decode", "timeout", "no /v1/models answer in time")
    except (aiohttp.ClientError, OSError) as exc:
        err = legs.LegError("decode", "connection", f"{type(exc).__name__}: {exc}")
    return web.json_response(err.to_json(""), status=err.http_status)


async def max_model_len(app: web.Application, headers: Mapping[str, str]) -> int | None:
    """The decoder's max_model_len, from its /v1/models (asked with `headers`: the
    client's authorization, `hops`); None if it does not say."""
    url = _decoder(app)
    if url is None:
        return None
    try:
        async with asyncio.timeout(_HEALTH_TIMEOUT_S):
            models_url = url + "/v1/models"
            async with app[SESSION].get(models_url, headers=headers) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json()
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    try:
        value = data["data"][0]["max_model_len"]
    except (KeyError, IndexError, TypeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


async def health(request: web.Request) -> web.Response:
    """To a caller the admin endpoints would answer (`admin.refusal`): 200 when at least
    one prefiller and one decoder answer their /health now and are not drained, per role
    every instance's probe and what the router knows of it. To anyone else: 200 and
    that the router is up, nothing more (no instance, no side channel, no probe: asking
    costs the upstreams nothing)."""
    if admin.refusal(request) is not None:
        return web.json_response({"status": "ok"})
    app = request.app
    cfg, pool = app[CONFIG], app[POOL]
    timeout = min(cfg.timeout, _HEALTH_TIMEOUT_S)
    instances = pool.all()
    probes = await asyncio.gather(
        *(legs.probe_health(app[SESSION], i.url, timeout) for i in instances)
    )
    payload: dict[str, Any] = {}
    for role in ("prefill", "decode"):
        mine = [(i, r) for i, r in zip(instances, probes, strict=True) if i.role == role]
        payload[role] = {
            "ok": any(r["ok"] and not i.draining for i, r in mine),
            "instances": [{**i.describe(), "probe": r} for i, r in mine],
        }
    ok = payload["prefill"]["ok"] and payload["decode"]["ok"]
    payload["status"] = "ok" if ok else "unavailable"
    return web.json_response(payload, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    ctype = "text/plain; version=0.0.4; charset=utf-8"
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": ctype})


async def known_max_model_len(app: web.Application, headers: Mapping[str, str]) -> int | None:
    """D's context length, from its /v1/models (asked with `headers`, as
    `max_model_len`): asked once, or again every `_ASK_AGAIN_S` while D cannot say
    (then None: no request waits on it)."""
    limits = app[LIMITS]
    now = time.monotonic()
    if limits.get("max_model_len") is None and now >= (limits.get("ask_at") or 0.0):
        limits["ask_at"] = now + _ASK_AGAIN_S
        limits["max_model_len"] = await max_model_len(app, headers)
    value = limits.get("max_model_len")
    return int(value) if value is not None else None
