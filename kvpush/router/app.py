"""HTTP handlers of the router: an OpenAI-compatible front for pools of prefill and
decode instances (`pool.py`; one pair is a pool of one each).

Per client request: pick a prefiller and a decoder (`Pool.choose`), issue a transfer id,
start the prefill leg and the decode leg at the same time (push only beats pull when P
does not wait for D or the other way round), and answer with the decode leg. Rules that
keep the client from ever hanging:

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

A leg that fails (connection, 5xx) before the client got a byte (unary: any time; stream:
before the first token, D's or P's, which the client's 200 waits for: `streaming.py`)
sends the whole request again, with a new transfer id, on another pair without the
failed instance (at most `RouterConfig.retries` times); after the first byte the failure
is reported in-stream.

A request P cannot help with (``bodies.decoder_alone``: prompt logprobs, beam search,
prompt embeddings, a body that is not a JSON object or not sent as JSON) goes to the
decoder alone, with the client's other fields as sent.

The client's body is checked at the boundary first (`boundary.py`: concurrency, header
encoding, size, read deadline, nesting), and its own ``kv_transfer_params`` are dropped
(`bodies.untrusted`) before any path to an upstream starts: only the router sets them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from kvpush.core import trace
from kvpush.router import (
    admin,
    bodies,
    boundary,
    head,
    info,
    jsonbody,
    legs,
    replies,
    upkeep,
    wire,
)
from kvpush.router.config import (
    BACKGROUND,
    CONFIG,
    LIMITS,
    METRICS,
    POOL,
    SESSION,
    UPSTREAMS,
    RouterConfig,
)
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Instance, Pool, Role, affinity_key
from kvpush.router.streaming import REFUSAL_GRACE_S, Outcome, serve_stream, settle
from kvpush.router.tracking import leg, refusal, succeeded

log = logging.getLogger(__name__)

T = TypeVar("T")


def make_app(config: RouterConfig) -> web.Application:
    """The router application; the upstream session lives as long as the app runs."""
    if not config.specs() and not config.config_path:
        raise ValueError("the router needs at least one prefill and one decode instance")
    # Long prompts are legitimate; aiohttp's default 1 MiB request limit is not enough.
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[METRICS] = RouterMetrics()
    app[BACKGROUND] = set()
    app[LIMITS] = {}
    pool = app[POOL] = Pool(config.policy)
    for spec in config.specs():
        pool.add(spec)
    app[METRICS].watch(lambda: [i.describe() for i in pool.all()])
    app.cleanup_ctx.append(_session_ctx)
    app.cleanup_ctx.append(upkeep.upkeep_ctx)
    boundary.install(app)
    admin.add_routes(app)
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
    app[UPSTREAMS] = wire.Upstreams()
    yield
    background: set[asyncio.Task[Any]] = app[BACKGROUND]
    pending = list(background)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    app[UPSTREAMS].close()
    await session.close()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/completions", chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "/v1/chat/completions", chat=True)


async def _proxy(request: web.Request, path: str, chat: bool) -> web.StreamResponse:
    # Read and checked by the boundary (a refusal there is the router's own answer), and
    # the client's own kv_transfer_params dropped: every leg below starts from `body`.
    raw = await boundary.read_body(request)
    body = boundary.parse(request, raw)
    if isinstance(body, dict):
        if (why := bodies.bad_params(body)) is not None:
            request.app[METRICS].refused("bad_kv_transfer_params")
            raise boundary.Refused(boundary.error(400, why))
        body = bodies.untrusted(body)
    app = request.app
    cfg, metrics, pool = app[CONFIG], app[METRICS], app[POOL]
    tid = uuid.uuid4().hex
    trace.mark("router.recv", tid)
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
        alone: str | None = "not_an_object"
        ctype = request.headers.get("Content-Type")
        if body is boundary.NOT_JSON:
            alone = "not_json"
        elif ctype is None or not _json_type(ctype):
            alone = "content_type"  # vLLM refuses it: D answers as a plain server does
        elif isinstance(body, dict):
            limit = await info.known_max_model_len(app, headers.get("Authorization"))
            alone = bodies.decoder_alone(body, chat, limit)
        if alone is not None:
            metrics.decoder_alone(alone)
            log.debug("transfer %s: to the decoder alone (%s)", tid, alone)
            headers["Content-Type"] = ctype if ctype is not None else ""  # (vLLM: as none)
            d = pool.choose("decode")
            if d is None:
                return replies.none_available(app, "decode", tid)
            # An object is written from what was read, less the client's
            # kv_transfer_params; only what has no fields (not JSON, not an object) goes
            # as the client sent it.
            data = jsonbody.dump(body) if isinstance(body, dict) else raw
            return await replies.serve_alone(request, path, data, headers, tid, d)
        assert isinstance(body, dict)
        key = affinity_key(body, chat, cfg.policy.affinity_chars)
        failed: dict[Role, set[str]] = {"prefill": set(), "decode": set()}
        err: legs.LegError | None = None
        for attempt in range(cfg.retries + 1):
            p = pool.choose("prefill", key, frozenset(failed["prefill"]))
            d = pool.choose("decode", None, frozenset(failed["decode"]))
            if p is None or d is None:
                if err is not None:  # no other pair to try: the last failure stands
                    return replies.leg_failed(app, err, tid)
                return replies.none_available(app, "prefill" if p is None else "decode", tid)
            if attempt:
                replies.count(app, err)  # type: ignore[arg-type]
                metrics.retried(err.leg)  # type: ignore[union-attr]
                log.warning("transfer %s: %s; sent again on another pair", tid, err)
                tid = headers["X-Request-Id"] = uuid.uuid4().hex
            again = attempt < cfg.retries and pool.spare("decode", {*failed["decode"], d.url})
            outcome = await _attempt(request, path, body, chat, headers, tid, p, d, stream, again)
            if not isinstance(outcome, legs.LegError):
                return outcome
            err = outcome
            if err.refused or err.kind == "timeout":
                break  # the client's mistake, or its patience already spent once
            failed[err.leg].add((p if err.leg == "prefill" else d).url)
        assert err is not None
        return replies.leg_failed(app, err, tid)
    finally:
        metrics.request_finished(endpoint, time.monotonic() - start)


async def _attempt(
    request: web.Request,
    path: str,
    body: dict[str, Any],
    chat: bool,
    headers: dict[str, str],
    tid: str,
    p: Instance,
    d: Instance,
    stream: bool,
    retry_ok: bool,
) -> Outcome:
    """One try of the request on the pair (p, d), both legs at once."""
    app = request.app
    cfg, metrics = app[CONFIG], app[METRICS]
    early = stream and head.eligible(body, chat)  # P's first token may go to the client
    pbody = (head.prefill_body if early else bodies.prefill_body)(body, tid, chat)
    call = legs.call_unary(app[UPSTREAMS], "prefill", p.url + path, pbody, headers, cfg.timeout)
    # Created before anything is awaited: both legs run concurrently.
    prefill = asyncio.create_task(leg(metrics, p, _checked(call) if early else call))
    if trace.ON:  # P's answer (its first token, as one plain server would send it)
        prefill.add_done_callback(lambda _: trace.mark("router.p_answer", tid))
    dbody = bodies.decode_body(body, tid, p.spec.side_channel, cfg.decode_kv_extra)
    log.debug("transfer %s: legs started on %s and %s (stream=%s)", tid, p.url, d.url, stream)
    if stream:
        args = (request, path, dbody, dict(headers), prefill, tid, p, d)
        return await serve_stream(*args, retry_ok, chat if early else None)
    return await _serve_unary(request, path, dbody, dict(headers), prefill, tid, d)


def _json_type(ctype: str) -> bool:
    """A Content-Type vLLM reads as JSON (FastAPI: application/json or */*+json)."""
    mime = ctype.split(";", 1)[0].strip().lower()
    return mime.startswith("application/") and (
        mime == "application/json" or mime.endswith("+json")
    )


async def _checked(call: Awaitable[legs.LegResult]) -> legs.LegResult:
    return head.check_answer(await call)


async def _until_decode_done(prefill: asyncio.Task[Any], decode: asyncio.Task[T]) -> T:
    """Wait for the decode task; raise the prefill leg's error if it fails first."""
    while not decode.done():
        if succeeded(prefill):  # only D left to watch: awaiting its task directly is a
            # loop turn sooner than asyncio.wait (a cancel here cancels it, as cleanup would)
            return await decode
        waiting = {decode} if prefill.done() else {prefill, decode}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        # Checked before the decode result: a decode leg that fails because P failed
        # should be reported as the prefill failure that caused it.
        if prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
            err = prefill.exception()
            if isinstance(err, legs.LegError) and err.refused:
                await asyncio.wait({decode}, timeout=REFUSAL_GRACE_S)
                own = refusal(decode)
                if own is not None:
                    raise own
            raise err  # type: ignore[misc]
    return decode.result()


async def _serve_unary(
    request: web.Request,
    path: str,
    dbody: dict[str, Any],
    headers: dict[str, str],
    prefill: asyncio.Task[Any],
    tid: str,
    d: Instance,
) -> Outcome:
    app = request.app
    cfg = app[CONFIG]
    call = legs.call_unary(app[UPSTREAMS], "decode", d.url + path, dbody, headers, cfg.timeout)
    decode = asyncio.create_task(leg(app[METRICS], d, call))
    ok = False
    try:
        result = await _until_decode_done(prefill, decode)
        ok = True
    except legs.LegError as err:
        return err
    finally:
        settle(app, tid, prefill, ok, decode)
    return web.Response(
        body=result.body,
        status=result.status,
        headers={"Content-Type": result.content_type, "X-Request-Id": tid},
    )
