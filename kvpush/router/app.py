"""HTTP handlers of the router: an OpenAI-compatible front for pools of prefill and
decode instances (`pool.py`; one pair is a pool of one each).

Per client request (`_proxy`, to be read top to bottom): read it into one `Call`
(`call.py`: what every later step needs), pick a prefiller and a decoder (`Pool.choose`),
start the prefill leg and the decode leg at the same time (`_attempt`; push only beats
pull when P does not wait for D or the other way round), and answer with the decode leg
(`unary.py`, `streaming.py`). Rules that keep the client from ever hanging:

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

A request P cannot help with (`alone.reason`: prompt logprobs, beam search, prompt
embeddings, a body that is not a JSON object or not sent as JSON) goes to the decoder
alone, with the client's other fields as sent (`alone.serve`).

The client's body is checked at the boundary first (`boundary.py`: concurrency, header
encoding, size, read deadline, nesting), and its own ``kv_transfer_params`` are dropped
(`bodies.untrusted`) before any path to an upstream starts: only the router sets them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.core import trace
from kvpush.router import (
    admin,
    alone,
    bodies,
    boundary,
    head,
    info,
    legs,
    replies,
    streaming,
    unary,
    upkeep,
    wire,
)
from kvpush.router.call import Call, Outcome, new_tid
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
from kvpush.router.pool import Pool, Role, affinity_key
from kvpush.router.tracking import leg

log = logging.getLogger(__name__)


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
    """One client request, top to bottom: read into a `Call`, then the decoder alone, or
    attempts on pairs (`_attempt`) until one answers, and the reply."""
    call = await _read(request, path, chat)
    try:
        if (why := await alone.reason(call)) is not None:
            return await alone.serve(call, why)
        assert isinstance(call.body, dict)
        key = affinity_key(call.body, chat, call.cfg.policy.affinity_chars)
        failed: dict[Role, set[str]] = {"prefill": set(), "decode": set()}
        err: legs.LegError | None = None
        for attempt in range(call.cfg.retries + 1):
            p = call.pool.choose("prefill", key, frozenset(failed["prefill"]))
            d = call.pool.choose("decode", None, frozenset(failed["decode"]))
            if p is None or d is None:
                if err is not None:  # no other pair to try: the last failure stands
                    return replies.leg_failed(call, err)
                return replies.none_available(call, "prefill" if p is None else "decode")
            if err is not None:
                replies.count(call, err)
                call.metrics.retried(err.leg)
                log.warning("transfer %s: %s; sent again on another pair", call.tid, err)
                call.new_transfer()
            call.attempt, call.p, call.d = attempt, p, d
            call.retry_ok = attempt < call.cfg.retries and call.pool.spare(
                "decode", {*failed["decode"], d.url}
            )
            outcome = await _attempt(call)
            if not isinstance(outcome, legs.LegError):
                return outcome
            err = outcome
            if err.refused or err.kind == "timeout":
                break  # the client's mistake, or its patience already spent once
            failed[err.leg].add((p if err.leg == "prefill" else d).url)
        assert err is not None
        return replies.leg_failed(call, err)
    finally:
        call.metrics.request_finished(call.endpoint, time.monotonic() - call.started)


async def _read(request: web.Request, path: str, chat: bool) -> Call:
    """The request read and checked by the boundary (a refusal there is the router's own
    answer), less the client's kv_transfer_params, as a `Call`; counted in."""
    raw = await boundary.read_body(request)
    body = boundary.parse(request, raw)
    if isinstance(body, dict) and not bodies.vllm_refuses_params(body):
        body = bodies.untrusted(body)
    tid = new_tid()
    trace.mark("router.recv", tid)
    # The same request id on both legs lets P and D match each other even without
    # transfer_id support (the in-tree connectors match on it), and gives the engine
    # sub-requests of one client request the same ids on both (the connector's keys).
    headers = {"X-Request-Id": tid, **boundary.upstream_headers(request)}
    stream = isinstance(body, dict) and body.get("stream") is True
    endpoint = path.rsplit("/", 1)[-1] if not chat else "chat_completions"
    call = Call(request, path, chat, endpoint, raw, body, stream, tid, headers)
    call.metrics.request_started(endpoint, stream)
    call.started = time.monotonic()
    return call


async def _attempt(call: Call) -> Outcome:
    """One try of the request on the pair chosen: both legs at once, then D's answer."""
    p, d = call.pair
    cfg, tid = call.cfg, call.tid
    call.early = call.stream and head.eligible(call.body, call.chat)  # P's token may go first
    pbody = (head.prefill_body if call.early else bodies.prefill_body)(call.body, tid, call.chat)
    bodies.seal_params(pbody, cfg.params_secret)
    url = p.url + call.path
    # P's stream read as it comes: its head before its end (`head.Early`); traced, P's
    # first piece at the router, apart from its whole answer (`router.p_answer`).
    early = head.Early(call.chat, head.ids_hidden(call.body, call.chat)) if call.early else None
    on_piece = _on_piece(early, tid) if early is not None or trace.ON else None
    p_leg = legs.call_unary(
        call.upstreams, "prefill", url, pbody, call.headers, call.timeout, on_piece
    )
    # Created before anything is awaited: both legs run concurrently.
    work = _checked(p_leg) if call.early else p_leg
    prefill = call.prefill_task = asyncio.create_task(leg(call.metrics, p, work))
    if trace.ON:  # P's answer (its first token, as one plain server would send it)
        prefill.add_done_callback(lambda _: trace.mark("router.p_answer", tid))
    dbody = bodies.decode_body(call.body, tid, p.spec.side_channel, cfg.decode_kv_extra)
    bodies.seal_params(dbody, cfg.params_secret)
    log.debug("transfer %s: legs started on %s and %s (stream=%s)", tid, p.url, d.url, call.stream)
    if call.stream:
        return await streaming.serve(call, dbody, early)
    return await unary.serve(call, dbody)


def _on_piece(early: head.Early | None, tid: str) -> Callable[[bytes, str], None]:
    """What P's pieces go to: `early`, and traced, the marks of P's first piece and of
    its head."""
    pieces = 0

    def on_piece(piece: bytes, content_type: str) -> None:
        nonlocal pieces
        pieces += 1
        if trace.ON and pieces == 1:
            trace.mark("router.p_piece", tid)
        if early is None or early.ready.done():
            return
        early.feed(piece, content_type)
        if trace.ON and early.ready.done():
            trace.mark("router.p_head", tid)

    return on_piece


async def _checked(answer: Awaitable[legs.LegResult]) -> legs.LegResult:
    return head.check_answer(await answer)
