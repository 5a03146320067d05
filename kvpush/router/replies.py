"""The router's answers that are not a relayed upstream answer: errors (a leg's failure,
no instance available), and the decoder-alone path (the client's body as sent, D's answer
whatever it is), plus the relay of a stream to the client."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from kvpush.router import legs, sse
from kvpush.router.config import CONFIG, METRICS, UPSTREAMS
from kvpush.router.pool import Instance, Role
from kvpush.router.tracking import Verdict, timed, using

log = logging.getLogger("kvpush.router.app")


def json_error(status: int, payload: dict[str, Any], transfer_id: str | None) -> web.Response:
    headers = {"X-Request-Id": transfer_id} if transfer_id else None
    return web.json_response(payload, status=status, headers=headers)


def none_available(app: web.Application, role: Role, tid: str) -> web.Response:
    app[METRICS].unavailable(role)
    payload = {
        "error": {
            "message": f"no {role} instance available (all down, drained or failing)",
            "type": "service_unavailable",
            "code": 503,
            "leg": role,
            "transfer_id": tid,
        }
    }
    log.warning("transfer %s: no %s instance available", tid, role)
    return json_error(503, payload, tid)


def count(app: web.Application, err: legs.LegError) -> None:
    app[METRICS].error(err.leg, "refused" if err.refused else err.kind)


def leg_failed(app: web.Application, err: legs.LegError, tid: str) -> web.Response:
    count(app, err)
    if err.refused:
        # The client's mistake: vLLM's own status and body, as one plain server answers.
        log.info("transfer %s: %s", tid, err)
        headers = {"Content-Type": err.content_type, "X-Request-Id": tid}
        return web.Response(body=err.body, status=err.http_status, headers=headers)
    log.warning("transfer %s: %s", tid, err)
    return json_error(err.http_status, err.to_json(tid), tid)


async def serve_alone(
    request: web.Request,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    tid: str,
    d: Instance,
) -> web.StreamResponse:
    """The request as the client sent it, to the decoder alone; its answer, whatever it is."""
    app = request.app
    cfg, metrics = app[CONFIG], app[METRICS]
    url = d.url + path
    with using(metrics, d) as verdict:
        try:
            upstream = await legs.open_stream(
                app[UPSTREAMS], "decode", url, raw, headers, cfg.timeout, any_status=True
            )
        except legs.LegError as err:
            verdict.judge(err)
            return leg_failed(app, err, tid)
        ok = False
        try:
            ctype = upstream.headers.get("Content-Type", "application/json")
            out_headers = {"Content-Type": ctype, "X-Request-Id": tid}
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await timed(metrics, d, legs.read_all(upstream, "decode", cfg.timeout))
                except legs.LegError as err:
                    verdict.judge(err)
                    return leg_failed(app, err, tid)
                ok = verdict.ok = upstream.status < 500
                if not ok:
                    verdict.failed = "upstream"
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            out = web.StreamResponse(
                status=upstream.status, headers={**out_headers, "Cache-Control": "no-cache"}
            )
            client = sse.chunked_to(request, out)
            await out.prepare(request)
            copy = sse.pump(upstream, out, "decode", cfg.timeout, client=client)
            pump = timed(metrics, d, copy)
            ok = verdict.ok = await relayed(app, out, tid, pump, verdict)
            if ok:
                await end(out)
            return out
        finally:
            upstream.release() if ok else upstream.close()


async def relayed(
    app: web.Application,
    out: web.StreamResponse,
    tid: str,
    relay: Awaitable[bool],
    verdict: Verdict,
) -> bool:
    """Await a stream's relay to the client; True when it ended cleanly. A failed leg is
    reported in-stream (the client already has its 200); a client gone is logged."""
    try:
        return await relay
    except legs.LegError as err:
        count(app, err)
        if err.leg == "decode":
            verdict.judge(err)
        log.warning("transfer %s: failed mid-stream: %s", tid, err)
        await sse.write_error(out, err.to_json(tid))
    except ConnectionError:
        log.info("transfer %s: client went away mid-stream", tid)
    return False


async def end(out: web.StreamResponse) -> None:
    """Close a relayed stream; a client that left right after [DONE] is no error."""
    try:
        await out.write_eof()
    except ConnectionError:
        log.debug("client gone before the end of its stream was written")
