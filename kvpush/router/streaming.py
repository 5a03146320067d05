"""The streamed answer of a split request.

The client's 200 waits for the first thing it gets: D's first chunk (D's headers come at
once, its first chunk with the first token), or, for a request that qualifies
(`head.eligible`), P's answer with the first token when it comes first (`head`); the
client then gets D's stream without D's copy of that token. A failure before the client's
200 is returned as a `LegError` (the caller may send the request again); after it, it is
reported in-stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from kvpush.core import trace
from kvpush.router import head, legs, replies, sse, tracking, wire
from kvpush.router.call import Call, Outcome
from kvpush.router.tracking import REFUSAL_GRACE_S, retrieve, settle, succeeded, timed, using

log = logging.getLogger("kvpush.router.app")

_Opened = tuple[wire.Response, bytes]  # D's stream and its first piece
# Why the client got the first token it got: P's answer came first and was one token as a
# plain server writes it; D's first chunk came first; P's leg failed; P's answer was not
# such a token (`head.from_answer`: it ended for another reason, or had no text).
FIRST_WHY = ("p_first", "d_first", "p_failed", "p_unusable")


async def serve(call: Call, dbody: dict[str, Any], early: head.Early | None = None) -> Outcome:
    """The decode stream; for an eligible request (`call.early`, whose P's stream `early`
    reads as it comes), P's first token may come first."""
    p, d = call.pair
    prefill, metrics = call.prefill, call.metrics
    with using(metrics, d) as verdict:
        interrupt = tracking.Interrupt(prefill, p, REFUSAL_GRACE_S)
        opening: asyncio.Task[_Opened] | None = None
        got: _Opened | head.Head | None = None
        try:
            if early is None:
                got = await open_first(call, dbody, call.retry_ok)
            else:
                opening = asyncio.create_task(open_first(call, dbody, call.retry_ok))
                got, why = await _first_of(opening, prefill, early)
                metrics.first_token("prefill" if isinstance(got, head.Head) else "decode", why)
            err = tracking.prefill_first(prefill, None)
        except legs.LegError as own:
            err = tracking.prefill_first(prefill, own)
        except asyncio.CancelledError:
            err = interrupt.caught()
            if err is None:
                _abandon(opening, got)
                settle(call, False)
                raise
        except BaseException:
            _abandon(opening, got)
            settle(call, False)
            raise
        finally:
            interrupt.close()
        if err is not None:
            _abandon(opening, got)
            settle(call, False)
            if not isinstance(err, legs.LegError):
                raise err
            if err.leg == "decode":
                verdict.judge(err)
            return err
        assert got is not None
        trace.mark("router.first_chunk", call.tid)
        # From here the client has a 200: a later failure can only be reported in-stream.
        upstream: wire.Response | None = None
        if isinstance(got, head.Head):
            assert early is not None  # a head comes only from P's leg that `early` reads
            ctype, status = early.content_type or prefill.result().content_type, 200
        else:
            upstream, start = got
            ctype = upstream.headers.get("Content-Type", "text/event-stream")
            status = upstream.status
        out = web.StreamResponse(
            status=status,
            headers={"Content-Type": ctype, "Cache-Control": "no-cache", "X-Request-Id": call.tid},
        )
        client = sse.chunked_to(call.request, out)
        ok = False
        try:
            await out.prepare(call.request)
            trace.mark("router.prepared", call.tid)
            if upstream is None:
                assert isinstance(got, head.Head) and opening is not None
                await out.write(got.events)
                copy = _after_head(call, dbody, opening, got, out, client)
            else:
                copy = sse.pump(upstream, out, "decode", call.timeout, start, client)
            relay = timed(metrics, d, copy)
            if not succeeded(prefill):  # its failure ends the stream, in-stream
                relay = tracking.watched(prefill, relay, REFUSAL_GRACE_S)
            ok = await replies.relayed(call, out, relay, verdict)
        except ConnectionError:
            log.info("transfer %s: client went away mid-stream", call.tid)
        finally:
            # An unfinished stream's connection is closed, not pooled: D sees the hang-up
            # and aborts the request.
            if upstream is None:
                upstream = _opened(opening)
            if upstream is not None:
                upstream.release() if ok else upstream.close()
            _stop(opening)
            settle(call, ok)
        verdict.ok = ok
    if ok:
        await replies.end(out)
    return out


async def _first_of(
    opening: asyncio.Task[_Opened],
    prefill: asyncio.Task[Any],
    early: head.Early,
) -> tuple[_Opened | head.Head, str]:
    """D's first chunk, or P's first token when P's answer (its head, `early`, or the
    whole of it) comes first and has one; and why (`FIRST_WHY`)."""
    await asyncio.wait((opening, prefill, early.ready), return_when=asyncio.FIRST_COMPLETED)
    if opening.done():
        why = "d_first"
    elif early.ready.done():
        return early.ready.result(), "p_first"
    elif not succeeded(prefill):
        why = "p_failed"
    else:
        got = head.from_answer(prefill.result().body, early.chat, early.hide_ids)
        if got is not None:
            return got, "p_first"
        why = "p_unusable"
    return await opening, why


async def _after_head(
    call: Call,
    dbody: dict[str, Any],
    opening: asyncio.Task[_Opened],
    first: head.Head,
    out: web.StreamResponse,
    client: asyncio.Transport | None,
) -> bool:
    """The relay of D's stream once the client has P's first token: D's first piece (a
    P that answered and then left the pool never pushes: an in-stream error at once),
    then D's stream without its copy of the head. When D's first token is not P's, D's
    continuation would not follow the client's first token: D goes on from P's token
    (`_continued`), or computes the request again (`head.again_body`), and that stream,
    whose first token must be P's, goes on."""
    chat, timeout = call.chat, call.timeout
    upstream, piece = await tracking.watched(call.prefill, opening, REFUSAL_GRACE_S, call.p)
    trace.mark("router.d_piece", call.tid)
    piece, differs = await _trimmed(upstream, piece, first, chat, timeout)
    if not differs:
        return await sse.pump(upstream, out, "decode", timeout, piece, client)
    call.metrics.first_token_mismatch()
    upstream.close()  # D aborts that request and frees its blocks
    onward = head.continue_body(dbody, first)
    if onward is not None:
        log.warning("D's first token differed from P's, which the client has: D goes on from P's")
        try:
            upstream, piece = await open_first(call, onward, True)
        except legs.LegError as e:
            if not e.refused:  # say, a prompt one token too long for D's model length
                raise
            log.warning("transfer %s: D refused to go on from P's token: %s", call.tid, e)
        else:
            return await _continued(upstream, piece, out, timeout)
    log.warning("D's first token differed from P's, which the client has: D computes it again")
    upstream, piece = await open_first(call, head.again_body(dbody, call.tid), True)
    ok = False
    try:
        piece, differs = await _trimmed(upstream, piece, first, chat, timeout)
        if differs:
            raise legs.LegError("decode", "upstream", "D's first token differed from P's twice")
        ok = await sse.pump(upstream, out, "decode", timeout, piece, client)
        return ok
    finally:
        upstream.release() if ok else upstream.close()


async def _continued(
    upstream: wire.Response, piece: bytes, out: web.StreamResponse, timeout: float
) -> bool:
    """D's answer to the request going on from P's token, relayed as the rest of the
    client's stream (`head.Continued`)."""
    ok = False
    try:
        ok = await sse.pump(upstream, out, "decode", timeout, piece, edit=head.Continued())
        return ok
    finally:
        upstream.release() if ok else upstream.close()


async def _trimmed(
    upstream: wire.Response, piece: bytes, first: head.Head, chat: bool, timeout: float
) -> tuple[bytes, bool]:
    """D's stream up to and including its first token, less what the client has from P;
    and whether that token differed from P's."""
    trim = head.Trim(first, chat)
    piece = trim.feed(piece)
    while not trim.done:
        more = await legs.read_chunk(upstream, "decode", timeout)
        if not more:
            break
        piece += trim.feed(more)
    return piece, trim.mismatch


def _opened(opening: asyncio.Task[_Opened] | None) -> wire.Response | None:
    if opening is None or not succeeded(opening):
        return None
    return opening.result()[0]


def _abandon(opening: asyncio.Task[_Opened] | None, got: Any) -> None:
    """Close D's stream of a request that ends before its relay, open or still opening."""
    upstream = got[0] if isinstance(got, tuple) else _opened(opening)
    if upstream is not None:
        upstream.close()
    _stop(opening)


def _stop(opening: asyncio.Task[_Opened] | None) -> None:
    if opening is not None:
        opening.add_done_callback(retrieve)
        opening.cancel()  # open_first closes what it opened; a done task is left as it is


async def open_first(call: Call, dbody: dict[str, Any], check: bool) -> _Opened:
    """Open the decode stream and read its first chunk. With `check`, a stream that
    begins with a server-side error event (vLLM's 5xx after its 200: say, no KV in time)
    is a `LegError`, so the request can be sent again; without, it is relayed as is."""
    url, timeout = call.pair[1].url + call.path, call.timeout
    upstream = await legs.open_stream(call.upstreams, "decode", url, dbody, call.headers, timeout)
    try:
        first = await legs.read_chunk(upstream, "decode", timeout)
        if not first:
            raise legs.LegError("decode", "connection", "the stream ended before any event")
        code = sse.error_code(first) if check else None
        if code is not None and code >= 500:
            detail = first[:500].decode("utf-8", errors="replace")
            raise legs.LegError("decode", "upstream", f"stream began with {detail}", code)
    except BaseException:
        upstream.close()
        raise
    return upstream, first
