"""HTTP handlers of the router: an OpenAI-compatible front for one prefill/decode pair.

Per client request: issue a transfer id, start the prefill leg and the decode leg at the
same time (push only beats pull when P does not wait for D or the other way round), and
answer with the decode leg. Rules that keep the client from ever hanging:

- every leg has its own timeout (`legs.py`), so every wait here ends;
- a prefill failure before the decode leg has finished fails the request and cancels the
  decode leg; a decode failure cancels the prefill leg (P would otherwise hold KV blocks
  for nobody until its lease expires);
- a prefill leg still running when the decode leg has succeeded is left to finish in the
  background, so the client is not slowed by it; its failure is only counted and logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvpush.router import legs
from kvpush.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

# Long prompts are legitimate; aiohttp's default 1 MiB request limit is not enough.
_MAX_REQUEST_BYTES = 64 * 1024 * 1024
_HEALTH_TIMEOUT_S = 5.0


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


def make_app(config: RouterConfig) -> web.Application:
    """The router application; the upstream session lives as long as the app runs."""
    app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
    app[CONFIG] = config
    app[METRICS] = RouterMetrics()
    app[BACKGROUND] = set()
    app.cleanup_ctx.append(_session_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    return app


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    # No session-wide timeout: each leg sets its own. No connection cap: the engines
    # queue requests themselves, and a router-side queue would eat the legs' timeouts.
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None),
        connector=aiohttp.TCPConnector(limit=0),
    )
    app[SESSION] = session
    yield
    background: set[asyncio.Task[Any]] = app[BACKGROUND]
    pending = list(background)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await session.close()


def _json_error(status: int, payload: dict[str, Any], transfer_id: str | None) -> web.Response:
    headers = {"X-Request-Id": transfer_id} if transfer_id else None
    return web.json_response(payload, status=status, headers=headers)


def _bad_request(message: str) -> web.Response:
    payload = {"error": {"message": message, "type": "invalid_request_error", "code": 400}}
    return _json_error(400, payload, None)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/completions", chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/chat/completions", chat=True)


async def _proxy(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _bad_request("request body is not valid JSON")
    if not isinstance(body, dict):
        return _bad_request("request body must be a JSON object")
    app = request.app
    cfg, metrics = app[CONFIG], app[METRICS]
    tid = uuid.uuid4().hex
    # The same request id on both legs lets P and D match each other even without
    # transfer_id support (the in-tree connectors match on it).
    headers = {"X-Request-Id": tid}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    stream = body.get("stream") is True
    endpoint = path.rsplit("/", 1)[-1] if not chat else "chat_completions"
    metrics.request_started(endpoint, stream)
    start = time.monotonic()
    # Both legs are created before anything is awaited: they run concurrently.
    prefill = asyncio.create_task(
        _timed(
            metrics,
            "prefill",
            legs.call_unary(
                app[SESSION],
                "prefill",
                cfg.prefill_url + path,
                legs.prefill_body(body, tid, chat),
                headers,
                cfg.timeout,
            ),
        )
    )
    dbody = legs.decode_body(body, tid, cfg.prefill_side_channel, cfg.decode_kv_extra)
    log.debug("transfer %s: legs started (stream=%s)", tid, stream)
    try:
        if stream:
            return await _serve_stream(request, path, dbody, headers, prefill, tid)
        return await _serve_unary(request, path, dbody, headers, prefill, tid)
    finally:
        metrics.request_finished(endpoint, time.monotonic() - start)


async def _timed(metrics: RouterMetrics, leg: str, coro: Awaitable[T]) -> T:
    start = time.monotonic()
    result = await coro
    metrics.leg_finished(leg, time.monotonic() - start)
    return result


async def _until_decode_done(prefill: asyncio.Task[Any], decode: asyncio.Task[T]) -> T:
    """Wait for the decode task; raise the prefill leg's error if it fails first."""
    while not decode.done():
        waiting = {decode} if prefill.done() else {prefill, decode}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        # Checked before the decode result: a decode leg that fails because P failed
        # should be reported as the prefill failure that caused it.
        if prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
            raise prefill.exception()  # type: ignore[misc]
    return decode.result()


def _settle(
    app: web.Application, tid: str, prefill: asyncio.Task[Any], decode_ok: bool, *others: Any
) -> None:
    """Cancel what is left of a request; keep a still-running prefill leg only on success."""
    for task in others:
        if isinstance(task, asyncio.Task) and not task.done():
            task.cancel()
    if prefill.done():
        return
    if not decode_ok:
        prefill.cancel()
        return
    background = app[BACKGROUND]
    metrics = app[METRICS]
    background.add(prefill)

    def _done(task: asyncio.Task[Any]) -> None:
        background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, legs.LegError):
            metrics.error(exc.leg, exc.kind)
            log.warning("transfer %s: prefill failed after decode finished: %s", tid, exc)
        elif exc is not None:
            log.error("transfer %s: prefill leg crashed", tid, exc_info=exc)

    prefill.add_done_callback(_done)


def _leg_failed(app: web.Application, err: legs.LegError, tid: str) -> web.Response:
    app[METRICS].error(err.leg, err.kind)
    log.warning("transfer %s: %s", tid, err)
    return _json_error(err.http_status, err.to_json(tid), tid)


async def _serve_unary(
    request: web.Request,
    path: str,
    dbody: dict[str, Any],
    headers: dict[str, str],
    prefill: asyncio.Task[Any],
    tid: str,
) -> web.StreamResponse:
    app = request.app
    cfg = app[CONFIG]
    decode = asyncio.create_task(
        _timed(
            app[METRICS],
            "decode",
            legs.call_unary(
                app[SESSION], "decode", cfg.decode_url + path, dbody, headers, cfg.timeout
            ),
        )
    )
    ok = False
    try:
        result = await _until_decode_done(prefill, decode)
        ok = True
    except legs.LegError as err:
        return _leg_failed(app, err, tid)
    finally:
        _settle(app, tid, prefill, ok, decode)
    return web.Response(
        body=result.body,
        status=result.status,
        headers={"Content-Type": result.content_type, "X-Request-Id": tid},
    )


async def _serve_stream(
    request: web.Request,
    path: str,
    dbody: dict[str, Any],
    headers: dict[str, str],
    prefill: asyncio.Task[Any],
    tid: str,
) -> web.StreamResponse:
    app = request.app
    cfg = app[CONFIG]
    opening = asyncio.create_task(
        legs.open_stream(app[SESSION], "decode", cfg.decode_url + path, dbody, headers, cfg.timeout)
    )
    try:
        upstream = await _until_decode_done(prefill, opening)
    except legs.LegError as err:
        _abandon_stream(app, tid, prefill, opening)
        return _leg_failed(app, err, tid)
    except BaseException:
        _abandon_stream(app, tid, prefill, opening)
        raise
    # From here the client has a 200: a later failure can only be reported in-stream.
    out = web.StreamResponse(
        status=upstream.status,
        headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": tid,
        },
    )
    ok = False
    pump: asyncio.Task[bool] | None = None
    try:
        await out.prepare(request)
        pump = asyncio.create_task(
            _timed(app[METRICS], "decode", _pump(upstream, out, cfg.timeout))
        )
        ok = await _until_decode_done(prefill, pump)
    except legs.LegError as err:
        app[METRICS].error(err.leg, err.kind)
        log.warning("transfer %s: failed mid-stream: %s", tid, err)
        # The OpenAI convention for an error after the stream has started.
        event = b"data: " + json.dumps(err.to_json(tid)).encode() + b"\n\n"
        try:
            await out.write(event)
        except ConnectionError:
            pass  # the client is gone too
    except ConnectionError:
        log.info("transfer %s: client went away mid-stream", tid)
    finally:
        upstream.release()
        _settle(app, tid, prefill, ok, pump)
    if ok:
        await out.write_eof()
    return out


def _abandon_stream(
    app: web.Application,
    tid: str,
    prefill: asyncio.Task[Any],
    opening: asyncio.Task[aiohttp.ClientResponse],
) -> None:
    # The decode stream may have opened just as the prefill leg failed: give its
    # connection back rather than leak it.
    if opening.done() and not opening.cancelled() and opening.exception() is None:
        opening.result().release()
    _settle(app, tid, prefill, False, opening)


async def _pump(upstream: aiohttp.ClientResponse, out: web.StreamResponse, timeout: float) -> bool:
    """Copy the decode stream to the client piece by piece as it arrives."""
    while True:
        chunk = await legs.read_chunk(upstream, "decode", timeout)
        if not chunk:
            return True
        await out.write(chunk)


async def _models(request: web.Request) -> web.StreamResponse:
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
    return _json_error(err.http_status, err.to_json(""), None)


async def _health(request: web.Request) -> web.Response:
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


async def _metrics(request: web.Request) -> web.Response:
    text = request.app[METRICS].render()
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )
