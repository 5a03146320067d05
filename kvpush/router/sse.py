"""Copying an upstream's server-sent events to the client.

vLLM ends every stream, also one that failed inside, with ``data: [DONE]``. A stream
that stops before it (the upstream died, or its connection broke) is not a clean end:
the client gets an OpenAI-style error event, then ``[DONE]``, as vLLM itself writes an
error that happens after a stream has started.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router import legs

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


async def pump(
    upstream: aiohttp.ClientResponse,
    out: web.StreamResponse,
    leg: legs.LegName,
    timeout: float,
    first: bytes = b"",
) -> bool:
    """Copy the stream piece by piece as it arrives (starting with `first`, already
    read); True once it ended with [DONE].

    Raises `LegError` when the upstream stalls, breaks, or ends without [DONE]."""
    tail = b""
    while True:
        chunk = first or await legs.read_chunk(upstream, leg, timeout)
        first = b""
        if not chunk:
            if tail.rstrip().endswith(DONE):
                return True
            raise legs.LegError(leg, "connection", "the stream ended without [DONE]")
        await out.write(chunk)
        tail = (tail + chunk)[-64:]


async def write_error(out: web.StreamResponse, payload: dict[str, Any]) -> None:
    try:
        await out.write(error_event(payload))
    except ConnectionError:
        pass  # the client is gone too
