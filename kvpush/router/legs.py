"""Upstream calls of the router: the prefill leg and the decode leg of one client request.

Every call here is bounded by a timeout and turns every upstream failure into a
`LegError`, so the handlers only ever see a result or a `LegError` (never a hang, never
a raw aiohttp exception).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp

from kvpush.router import jsonbody, wire

LegName = Literal["prefill", "decode"]
# timeout: no answer in time; upstream: answered non-2xx; connection: could not talk to it.
ErrorKind = Literal["timeout", "upstream", "connection"]

# Upstream error bodies are echoed to the client for diagnosis, but bounded.
_MAX_DETAIL = 500
# A refusal (4xx) is passed to the client whole, up to this size.
_MAX_REFUSAL = 64 * 1024
_JSON = "application/json"
T = TypeVar("T")


class LegError(Exception):
    """One leg failed; carries what the client needs to know about why."""

    def __init__(
        self,
        leg: LegName,
        kind: ErrorKind,
        message: str,
        upstream_status: int | None = None,
        body: bytes = b"",
        content_type: str = "application/json",
    ) -> None:
        super().__init__(f"{leg} leg {kind}: {message}")
        self.leg: LegName = leg
        self.kind: ErrorKind = kind
        self.message = message
        self.upstream_status = upstream_status
        self.body = body
        self.content_type = content_type

    @property
    def refused(self) -> bool:
        """The upstream refused the request itself (4xx): the client's mistake, not an
        outage; the client gets that status and the upstream's own body."""
        status = self.upstream_status
        return self.kind == "upstream" and status is not None and 400 <= status < 500

    @property
    def http_status(self) -> int:
        """The upstream's own 4xx; else 504 for a timeout, 502 for anything else."""
        if self.refused:
            assert self.upstream_status is not None
            return self.upstream_status
        return 504 if self.kind == "timeout" else 502

    def to_json(self, transfer_id: str) -> dict[str, Any]:
        """OpenAI-style error object, so existing clients can parse it."""
        err: dict[str, Any] = {
            "message": str(self),
            "type": "upstream_timeout" if self.kind == "timeout" else "upstream_error",
            "code": self.http_status,
            "leg": self.leg,
            "kind": self.kind,
            "transfer_id": transfer_id,
        }
        if self.upstream_status is not None:
            err["upstream_status"] = self.upstream_status
        return {"error": err}


@dataclass(frozen=True)
class LegResult:
    """A complete (non-streamed) upstream answer."""

    status: int
    body: bytes
    content_type: str


def _upstream_error(leg: LegName, resp: wire.Response, data: bytes) -> LegError:
    detail = data[:_MAX_DETAIL].decode("utf-8", errors="replace")
    ctype = resp.headers.get("Content-Type", "application/json")
    return LegError(
        leg, "upstream", f"HTTP {resp.status}: {detail}", resp.status, data[:_MAX_REFUSAL], ctype
    )


# What an upstream call raises when it cannot talk to the upstream: OSError (refused,
# reset, wire.UpstreamClosed), ValueError (a URL that is not http(s)).
_UNREACHABLE = (OSError, ValueError)


async def _bounded(leg: LegName, timeout: float, late: str, work: Awaitable[T]) -> T:
    """`work` within `timeout` seconds, its failures as `LegError`s (`late`: what did not
    come in time)."""
    try:
        async with asyncio.timeout(timeout):
            return await work
    except TimeoutError:
        raise LegError(leg, "timeout", f"{late} {timeout:g}s") from None
    except _UNREACHABLE as exc:
        raise LegError(leg, "connection", f"{type(exc).__name__}: {exc}") from exc


async def call_unary(
    upstreams: wire.Upstreams,
    leg: LegName,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: float,
    on_piece: Callable[[bytes, str], object] | None = None,
) -> LegResult:
    """POST `body` and read the whole answer within `timeout` seconds. A 2xx answer's
    pieces also go to `on_piece` as they come, with its Content-Type (the head of P's
    stream, before the stream ends: `head.Early`)."""

    async def call() -> LegResult:
        resp = await upstreams.post(url, jsonbody.dump(body), headers, _JSON)
        try:
            if on_piece is None or not 200 <= resp.status < 300:
                data = await resp.read()
            else:
                ctype, parts = resp.headers.get("Content-Type", _JSON), []
                while piece := await resp.readany():
                    on_piece(piece, ctype)
                    parts.append(piece)
                data = b"".join(parts)
        finally:
            resp.release()
        if not 200 <= resp.status < 300:
            raise _upstream_error(leg, resp, data)
        return LegResult(resp.status, data, resp.headers.get("Content-Type", _JSON))

    return await _bounded(leg, timeout, "no complete answer within", call())


async def open_stream(
    upstreams: wire.Upstreams,
    leg: LegName,
    url: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str],
    timeout: float,
    any_status: bool = False,
) -> wire.Response:
    """POST `body` (a JSON object, or bytes sent as they are, with the Content-Type in
    `headers`) and return the response once its headers are in: 2xx only, unless
    `any_status`.

    The caller owns the returned response and must `release()` or `close()` it.
    """

    async def call() -> wire.Response:
        if isinstance(body, bytes):
            sent = dict(headers)
            ctype = sent.pop("Content-Type", _JSON)
            resp = await upstreams.post(url, body, sent, ctype)
        else:
            resp = await upstreams.post(url, jsonbody.dump(body), headers, _JSON)
        if not any_status and not 200 <= resp.status < 300:
            try:
                data = await resp.read()
            finally:
                resp.release()
            raise _upstream_error(leg, resp, data)
        return resp

    return await _bounded(leg, timeout, "no response headers within", call())


async def read_all(resp: wire.Response, leg: LegName, timeout: float) -> bytes:
    """The rest of a response's body, within `timeout` seconds."""
    return await _bounded(leg, timeout, "no complete answer within", resp.read())


async def read_chunk(resp: wire.Response, leg: LegName, timeout: float) -> bytes:
    """Next piece of a streamed body (b"" at its end); `timeout` bounds the gap between pieces."""
    return await _bounded(leg, timeout, "stream stalled for", resp.readany())


async def probe_health(
    session: aiohttp.ClientSession, base_url: str, timeout: float
) -> dict[str, Any]:
    """GET <base_url>/health; a dict saying whether it answered 200 and, if not, why."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(base_url + "/health") as resp:
                await resp.read()
                return {"ok": resp.status == 200, "status": resp.status}
    except TimeoutError:
        return {"ok": False, "error": f"no answer within {timeout:g}s"}
    except (aiohttp.ClientError, OSError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
