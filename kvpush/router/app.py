"""HTTP handlers of the router: an OpenAI-compatible front for one prefill/decode pair.

Per client request: issue a transfer id, start the prefill leg and the decode leg at the
same time (push only beats pull when P does not wait for D or the other way round), and
answer with the decode leg. Rules that keep the client from ever hanging:

- every leg has its own timeout (`legs.py`), so every wait here ends;
- a prefill failure before the decode leg has finished fails the request and cancels the
  decode leg; a decode failure cancels the prefill leg (P would otherwise hold KV blocks
  for nobody until its lease expires);
- a prefill leg still running when the decode leg has succeeded is left to finish in the
  background, so the client is not slowed by it; its failure is only counted and logged;
- a leg that refuses the request (HTTP 4xx: the client's mistake) gives the client that
  status and vLLM's own body at once, and the other leg is cancelled (its HTTP request
  closed, so vLLM aborts it); D got the client's body unchanged, so when P refuses, D's
  refusal (same as a plain server's) is preferred if it comes within a moment.

A request P cannot help with (``bodies.decoder_alone``: prompt logprobs, beam search,
prompt embeddings, a body that is not a JSON object) goes to the decoder alone, as sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvpush.router import bodies, info, legs, sse
from kvpush.router.config import BACKGROUND, CONFIG, LIMITS, METRICS, SESSION, RouterConfig
from kvpush.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

# Long prompts are legitimate; aiohttp's default 1 MiB request limit is not enough.
_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# How long to wait for D's own refusal once P refused (both validate the same fields).
_REFUSAL_GRACE_S = 1.0
_ASK_AGAIN_S = 10.0


def make_app(config: RouterConfig) -> web.Application:
    """The router application; the upstream session lives as long as the app runs."""
    app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
    app[CONFIG] = config
    app[METRICS] = RouterMetrics()
    app[BACKGROUND] = set()
    app[LIMITS] = {}
    app.cleanup_ctx.append(_session_ctx)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", info.models)
    app.router.add_get("/health", info.health)
    app.router.add_get("/metrics", info.metrics)
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


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/completions", chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/chat/completions", chat=True)


async def _proxy(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    app = request.app
    cfg, metrics = app[CONFIG], app[METRICS]
    tid = uuid.uuid4().hex
    # The same request id on both legs lets P and D match each other even without
    # transfer_id support (the in-tree connectors match on it), and gives the engine
    # sub-requests of one client request the same ids on both (the connector's keys).
    headers = {"X-Request-Id": tid}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    stream = isinstance(body, dict) and body.get("stream") is True
    endpoint = path.rsplit("/", 1)[-1] if not chat else "chat_completions"
    metrics.request_started(endpoint, stream)
    start = time.monotonic()
    try:
        alone: str | None = "not_json"
        if isinstance(body, dict):
            alone = bodies.decoder_alone(body, chat, await _max_model_len(app))
        if alone is not None:
            metrics.decoder_alone(alone)
            log.debug("transfer %s: to the decoder alone (%s)", tid, alone)
            headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
            return await _serve_alone(request, path, raw, headers, tid)
        assert isinstance(body, dict)
        # Both legs are created before anything is awaited: they run concurrently.
        prefill = asyncio.create_task(
            _timed(
                metrics,
                "prefill",
                legs.call_unary(
                    app[SESSION],
                    "prefill",
                    cfg.prefill_url + path,
                    bodies.prefill_body(body, tid, chat),
                    headers,
                    cfg.timeout,
                ),
            )
        )
        dbody = bodies.decode_body(body, tid, cfg.prefill_side_channel, cfg.decode_kv_extra)
        log.debug("transfer %s: legs started (stream=%s)", tid, stream)
        if stream:
            return await _serve_stream(request, path, dbody, headers, prefill, tid)
        return await _serve_unary(request, path, dbody, headers, prefill, tid)
    finally:
        metrics.request_finished(endpoint, time.monotonic() - start)


async def _max_model_len(app: web.Application) -> int | None:
    """D's context length, from its /v1/models: asked once, or again every
    `_ASK_AGAIN_S` while D cannot say (then None: no request waits on it)."""
    limits = app[LIMITS]
    now = time.monotonic()
    if limits.get("max_model_len") is None and now >= (limits.get("ask_at") or 0.0):
        limits["ask_at"] = now + _ASK_AGAIN_S
        limits["max_model_len"] = await info.max_model_len(app)
    value = limits.get("max_model_len")
    return int(value) if value is not None else None


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
            err = prefill.exception()
            if isinstance(err, legs.LegError) and err.refused:
                await asyncio.wait({decode}, timeout=_REFUSAL_GRACE_S)
                own = _refusal(decode)
                if own is not None:
                    raise own
            raise err  # type: ignore[misc]
    return decode.result()


def _refusal(task: asyncio.Task[Any]) -> legs.LegError | None:
    if not task.done() or task.cancelled():
        return None
    err = task.exception()
    return err if isinstance(err, legs.LegError) and err.refused else None


def _settle(
    app: web.Application, tid: str, prefill: asyncio.Task[Any], decode_ok: bool, *others: Any
) -> None:
    """Cancel what is left of a request; keep a still-running prefill leg only on success."""
    for task in others:
        if isinstance(task, asyncio.Task):
            # Its error (say, a write to a client that left) is the handler's to report;
            # retrieved here so that it is not logged again as never retrieved.
            task.add_done_callback(_retrieve)
            task.cancel()
    if prefill.done() or not decode_ok:
        prefill.add_done_callback(_retrieve)
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


def _count(app: web.Application, err: legs.LegError) -> None:
    app[METRICS].error(err.leg, "refused" if err.refused else err.kind)


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _leg_failed(app: web.Application, err: legs.LegError, tid: str) -> web.Response:
    _count(app, err)
    if err.refused:
        # The client's mistake: vLLM's own status and body, as one plain server answers.
        log.info("transfer %s: %s", tid, err)
        headers = {"Content-Type": err.content_type, "X-Request-Id": tid}
        return web.Response(body=err.body, status=err.http_status, headers=headers)
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
            _timed(app[METRICS], "decode", sse.pump(upstream, out, "decode", cfg.timeout))
        )
        ok = await _relayed(app, out, tid, _until_decode_done(prefill, pump))
    except ConnectionError:
        log.info("transfer %s: client went away mid-stream", tid)
    finally:
        # An unfinished stream's connection is closed, not pooled: D sees the hang-up
        # and aborts the request.
        upstream.release() if ok else upstream.close()
        _settle(app, tid, prefill, ok, pump)
    if ok:
        await out.write_eof()
    return out


async def _serve_alone(
    request: web.Request, path: str, raw: bytes, headers: dict[str, str], tid: str
) -> web.StreamResponse:
    """The request as the client sent it, to the decoder alone; its answer, whatever it is."""
    app = request.app
    cfg = app[CONFIG]
    url = cfg.decode_url + path
    try:
        upstream = await legs.open_stream(
            app[SESSION], "decode", url, raw, headers, cfg.timeout, any_status=True
        )
    except legs.LegError as err:
        return _leg_failed(app, err, tid)
    ok = False
    try:
        ctype = upstream.headers.get("Content-Type", "application/json")
        out_headers = {"Content-Type": ctype, "X-Request-Id": tid}
        if not ctype.startswith("text/event-stream"):
            try:
                data = await _timed(
                    app[METRICS], "decode", legs.read_all(upstream, "decode", cfg.timeout)
                )
            except legs.LegError as err:
                return _leg_failed(app, err, tid)
            ok = True
            return web.Response(body=data, status=upstream.status, headers=out_headers)
        out = web.StreamResponse(
            status=upstream.status, headers={**out_headers, "Cache-Control": "no-cache"}
        )
        await out.prepare(request)
        pump = _timed(app[METRICS], "decode", sse.pump(upstream, out, "decode", cfg.timeout))
        ok = await _relayed(app, out, tid, pump)
        if ok:
            await out.write_eof()
        return out
    finally:
        upstream.release() if ok else upstream.close()


async def _relayed(
    app: web.Application, out: web.StreamResponse, tid: str, relay: Awaitable[bool]
) -> bool:
    """Await a stream's relay to the client; True when it ended cleanly. A failed leg is
    reported in-stream (the client already has its 200); a client gone is logged."""
    try:
        return await relay
    except legs.LegError as err:
        _count(app, err)
        log.warning("transfer %s: failed mid-stream: %s", tid, err)
        await sse.write_error(out, err.to_json(tid))
    except ConnectionError:
        log.info("transfer %s: client went away mid-stream", tid)
    return False


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
