"""The answer of a split request that is not streamed: D's whole answer, once D is done
(or P's failure, when P fails first)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from aiohttp import web

from kvpush.router import legs
from kvpush.router.call import Call, Outcome
from kvpush.router.tracking import REFUSAL_GRACE_S, leg, refusal, settle, succeeded

T = TypeVar("T")


async def serve(call: Call, dbody: dict[str, Any]) -> Outcome:
    """D's answer; a `LegError` (either leg's) instead, for the caller to retry or report."""
    d = call.pair[1]
    unary = legs.call_unary(
        call.upstreams, "decode", d.url + call.path, dbody, call.headers, call.timeout
    )
    decode = asyncio.create_task(leg(call.metrics, d, unary))
    ok = False
    try:
        result = await _until_decode_done(call.prefill, decode)
        ok = True
    except legs.LegError as err:
        return err
    finally:
        settle(call, ok, decode)
    return web.Response(
        body=result.body,
        status=result.status,
        headers={"Content-Type": result.content_type, "X-Request-Id": call.tid},
    )


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
