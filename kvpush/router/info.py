"""The router's own endpoints: /v1/models, /health and /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kvpush.router import legs
from kvpush.router.config import CONFIG, METRICS, SESSION

_HEALTH_TIMEOUT_S = 5.0


async def models(request: web.Request) -> web.StreamResponse:
    # Benchmark clients ask for the model name; D serves the same model as P.
    app = request.app
    cfg = app[CONFIG]
    try:
        async with asyncio.timeout(_HEALTH_TIMEOUT_S):
            async with app[SESSION].get(cfg.decode_url + "/v1/models") as resp:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/json")
                return web.Response(body=data, status=resp.status, headers={"Content-Type": ctype})
    except TimeoutError:
        err = legs.LegError("decode", "timeout", "no /v1/models answer in time")
    except (aiohttp.ClientError, OSError) as exc:
        err = legs.LegError("decode", "connection", f"{type(exc).__name__}: {exc}")
    return web.json_response(err.to_json(""), status=err.http_status)


async def max_model_len(app: web.Application) -> int | None:
    """The decoder's max_model_len, from its /v1/models; None if it does not say."""
    cfg = app[CONFIG]
    try:
        async with asyncio.timeout(_HEALTH_TIMEOUT_S):
            async with app[SESSION].get(cfg.decode_url + "/v1/models") as resp:
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
    app = request.app
    cfg = app[CONFIG]
    timeout = min(cfg.timeout, _HEALTH_TIMEOUT_S)
    prefill, decode = await asyncio.gather(
        legs.probe_health(app[SESSION], cfg.prefill_url, timeout),
        legs.probe_health(app[SESSION], cfg.decode_url, timeout),
    )
    ok = prefill["ok"] and decode["ok"]
    payload = {"status": "ok" if ok else "unavailable", "prefill": prefill, "decode": decode}
    return web.json_response(payload, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[METRICS].render()
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )
