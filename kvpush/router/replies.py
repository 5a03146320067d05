"""The router's answers that are not a relayed upstream answer: errors (a leg's failure,
no instance available), and the end of a stream relayed to the client (`relayed`, `end`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from kvpush.router import legs, sse
from kvpush.router.call import Call
from kvpush.router.pool import Role
from kvpush.router.tracking import Verdict

log = logging.getLogger("kvpush.router.app")


def json_error(status: int, payload: dict[str, Any], transfer_id: str | None) -> web.Response:
    headers = {"X-Request-Id": transfer_id} if transfer_id else None
    return web.json_response(payload, status=status, headers=headers)


def none_available(call: Call, role: Role) -> web.Response:
    tid = call.tid
    call.metrics.unavailable(role)
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


def count(call: Call, err: legs.LegError) -> None:
    call.metrics.error(err.leg, "refused" if err.refused else err.kind)


def leg_failed(call: Call, err: legs.LegError) -> web.Response:
    tid = call.tid
    count(call, err)
    if err.refused:
        # The client's mistake: vLLM's own status and body, as one plain server answers.
        log.info("transfer %s: %s", tid, err)
        headers = {"Content-Type": err.content_type, "X-Request-Id": tid}
        return web.Response(body=err.body, status=err.http_status, headers=headers)
    log.warning("transfer %s: %s", tid, err)
    return json_error(err.http_status, err.to_json(tid), tid)


async def relayed(
    call: Call, out: web.StreamResponse, relay: Awaitable[bool], verdict: Verdict
) -> bool:
    """Await a stream's relay to the client; True when it ended cleanly. A failed leg is
    reported in-stream (the client already has its 200); a client gone is logged."""
    try:
        return await relay
    except legs.LegError as err:
        tid = call.tid
        count(call, err)
        if err.leg == "decode":
            verdict.judge(err)
        log.warning("transfer %s: failed mid-stream: %s", tid, err)
        await sse.write_error(out, err.to_json(tid))
    except ConnectionError:
        log.info("transfer %s: client went away mid-stream", call.tid)
    return False


async def end(out: web.StreamResponse) -> None:
    """Close a relayed stream; a client that left right after [DONE] is no error."""
    try:
        await out.write_eof()
    except ConnectionError:
        log.debug("client gone before the end of its stream was written")
