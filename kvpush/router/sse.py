"""Copying an upstream's server-sent events to the client.

vLLM ends every stream, also one that failed inside, with ``data: [DONE]``. A stream
that stops before it (the upstream died, or its connection broke) is not a clean end:
the client gets an OpenAI-style error event, then ``[DONE]``, as vLLM itself writes an
error that happens after a stream has started.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Protocol

from aiohttp import web

from kvpush.router import legs, wire

DONE = b"data: [DONE]"
# The client's unsent bytes above which a relayed piece waits for aiohttp's writer
# (which waits for the client) rather than going to its connection directly.
_DIRECT_LIMIT = 64 * 1024


def error_event(payload: dict[str, Any]) -> bytes:
    """An error event followed by the end of the stream."""
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"


def error_code(chunk: bytes) -> int | None:
    """The code of an error event that begins `chunk` (vLLM writes `data: {"error": …}`
    for a failure after its 200), else None."""
    text = chunk.lstrip()
    if not text.startswith(b'data: {"error"'):
        return None
    try:
        payload = json.loads(text[6:].split(b"\n", 1)[0])
        code = payload["error"].get("code")
    except (ValueError, KeyError, AttributeError, TypeError, RecursionError):
        return 500  # an error event, but not one of vLLM's: a server-side failure
    return code if isinstance(code, int) else 500


class Edit(Protocol):
    """Changes a stream's events on the way (`pump`): fed pieces in order, it returns what
    to pass on; `rest` what it still holds when the upstream ends."""

    def feed(self, piece: bytes) -> bytes: ...

    def rest(self) -> bytes: ...


class _Watchdog:
    """Cancels the current task once a read has waited `timeout` seconds. One timer per
    `timeout` period, re-armed lazily, where `asyncio.timeout` around each read arms and
    cancels one for every chunk; only time spent reading counts (a slow client's writes
    do not, as before)."""

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.timeout = timeout
        self.since = self.loop.time()  # when the current read began
        self.reading = False
        self.fired = False
        self.handle = self.loop.call_at(self.since + timeout, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        due = self.since + self.timeout if self.reading else now + self.timeout
        if now < due:
            self.handle = self.loop.call_at(due, self._check)
        elif self.task is not None:
            self.fired = True
            self.task.cancel()


async def pump(
    upstream: wire.Response,
    out: web.StreamResponse,
    leg: legs.LegName,
    timeout: float,
    first: bytes = b"",
    client: asyncio.Transport | None = None,
    edit: Edit | None = None,
) -> bool:
    """Copy the stream piece by piece as it arrives (starting with `first`, already
    read); True once it ended with [DONE]. With `edit`, every piece goes through it, and
    through aiohttp's writer.

    With `client` (the client's connection, for a response prepared with chunked
    encoding), once aiohttp's writer has sent the head, pieces go from the upstream
    connection's callback straight to it, framed as chunks, while it keeps up (its
    buffer under `_DIRECT_LIMIT`); otherwise, and for what the callback declines, the
    loop below writes through aiohttp, whose write waits for a slow client and raises
    for one gone.

    Raises `LegError` when the upstream stalls for `timeout` seconds, breaks, or ends
    without [DONE]."""
    watch = _Watchdog(timeout)
    tail = b""
    if edit is not None:
        client = None  # the direct path would pass pieces unedited
    chunk = edit.feed(first) if edit is not None and first else first

    def sink(data: bytes) -> bool:
        nonlocal tail
        assert client is not None
        if client.is_closing() or client.get_write_buffer_size() > _DIRECT_LIMIT:
            return False
        client.write(b"%x\r\n%s\r\n" % (len(data), data))
        tail = (tail + data)[-64:]
        watch.since = watch.loop.time()
        return True

    try:
        while True:
            if not chunk:
                if client is not None and tail:  # tail: the head went out before it
                    upstream.relay(sink)
                watch.since, watch.reading = watch.loop.time(), True
                try:
                    raw = await upstream.readany()
                except OSError as exc:
                    raise legs.LegError(leg, "connection", f"{type(exc).__name__}: {exc}") from exc
                finally:
                    upstream.relay(None)
                watch.reading = False
                chunk = raw
                if edit is not None:
                    chunk = edit.feed(raw) if raw else edit.rest()
                    if chunk:
                        await out.write(chunk)
                        tail = (tail + chunk)[-64:]
                        chunk = b""
                    if raw:
                        continue
                if not raw:
                    if tail.rstrip().endswith(DONE):
                        return True
                    raise legs.LegError(leg, "connection", "the stream ended without [DONE]")
            await out.write(chunk)
            tail = (tail + chunk)[-64:]
            chunk = b""
    except asyncio.CancelledError:
        if watch.fired and watch.task is not None and watch.task.uncancel() == 0:
            raise legs.LegError(leg, "timeout", f"stream stalled for {timeout:g}s") from None
        raise
    finally:
        watch.handle.cancel()


def chunked_to(request: web.Request, out: web.StreamResponse) -> asyncio.Transport | None:
    """The client's connection for `pump` to write chunks to directly: set up before
    `out` is prepared, for an HTTP/1.1 client (an HTTP/1.0 one gets no chunked
    encoding: aiohttp's writer then copies the stream as it is)."""
    if request.version < (1, 1) or out.status in (204, 304):
        return None
    out.enable_chunked_encoding()
    return request.transport  # type: ignore[return-value]


async def write_error(out: web.StreamResponse, payload: dict[str, Any]) -> None:
    try:
        await out.write(error_event(payload))
    except ConnectionError:
        pass  # the client is gone too
