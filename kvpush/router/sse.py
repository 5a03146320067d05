"""Copying an upstream's server-sent events to the client.

vLLM ends every stream, also one that failed inside, with ``data: [DONE]``. A stream
that stops before it (the upstream died, or its connection broke) is not a clean end:
the client gets an OpenAI-style error event, then ``[DONE]``, as vLLM itself writes an
error that happens after a stream has started.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from kvpush.router import legs, wire

DONE = b"data: [DONE]"


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
    except (ValueError, KeyError, AttributeError, TypeError):
        return 500
    return code if isinstance(code, int) else 500


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
) -> bool:
    """Copy the stream piece by piece as it arrives (starting with `first`, already
    read); True once it ended with [DONE].

    Raises `LegError` when the upstream stalls for `timeout` seconds, breaks, or ends
    without [DONE]."""
    watch = _Watchdog(timeout)
    tail = b""
    chunk = first
    try:
        while True:
            if not chunk:
                watch.since, watch.reading = watch.loop.time(), True
                try:
                    chunk = await upstream.readany()
                except OSError as exc:
                    raise legs.LegError(leg, "connection", f"{type(exc).__name__}: {exc}") from exc
                watch.reading = False
                if not chunk:
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


async def write_error(out: web.StreamResponse, payload: dict[str, Any]) -> None:
    try:
        await out.write(error_event(payload))
    except ConnectionError:
        pass  # the client is gone too
