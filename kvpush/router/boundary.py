"""The router's boundary with its clients: what it checks before a client request reaches
any upstream. Every refusal here is the router's own answer: no upstream sees the
request, so none is judged by it (no breaker moves).

- at most `RouterConfig.max_concurrent` client requests at once (`guard`); beyond, 503
  with ``Retry-After``, before the body is read;
- the headers the router forwards upstream must be printable ASCII: 400. A value
  beyond Latin-1 (``Bearer €``) could not be written upstream, and failed the leg as the
  upstream's failure (three such requests opened healthy instances' breakers); one
  within Latin-1 but beyond ASCII would reach the upstream as other bytes than the
  client sent (aiohttp reads header bytes as UTF-8);
- a request that went through this router already (`hops`): 508, before its body is read;
- the body (`read_body`): 413 above `RouterConfig.max_body_bytes`; 408 and the
  connection closed when it does not arrive within `RouterConfig.body_timeout`;
- its JSON (`parse`): 400 for a body nested deeper than `MAX_DEPTH` (a body too deep
  for the parser was a 500 with a traceback; a plain vLLM server answers 400). A body
  that is not JSON at all goes to the decoder alone as sent, for vLLM's own 400 word
  for word: vLLM reads a body with the same ``json.loads``, so it cannot read any
  field of it either.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from kvpush.router import hops, jsonbody
from kvpush.router.config import CONFIG, METRICS

# The endpoints that serve clients (and call upstreams on their behalf).
CLIENT_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/models"))
# Headers the router passes on to an upstream (`app._proxy`, `info`).
FORWARDED = ("Authorization", "Content-Type")
# Deeper JSON is refused. Well below Python's recursion limit, which both the parser and
# the writer of the legs share with the handler's own frames; vLLM's own request fields
# nest a few levels (a tool's JSON schema a few dozen).
MAX_DEPTH = 512
_IN_FLIGHT: web.AppKey[list[int]] = web.AppKey("client_requests_in_flight")


class Refused(Exception):
    """A client request the router answers itself, with `response`."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.status)
        self.response = response


def error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An error in vLLM's own shape (OpenAI's), so that clients parse it as one."""
    payload = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(payload, status=status)


def install(app: web.Application) -> None:
    app[_IN_FLIGHT] = [0]
    hops.install(app)
    app.middlewares.append(guard)


@web.middleware
async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path not in CLIENT_PATHS:
        return await handler(request)  # type: ignore[no-any-return]
    app = request.app
    count = app[_IN_FLIGHT]
    if count[0] >= app[CONFIG].max_concurrent:
        app[METRICS].refused("busy")
        resp = error(503, "the router is at its limit of concurrent requests", "ServiceUnavailable")
        resp.headers["Retry-After"] = "1"
        return resp
    for name in FORWARDED:
        value = request.headers.get(name)
        if value is not None and not _plain(value):
            app[METRICS].refused("header")
            return error(400, f"header {name}: the value is not printable ASCII")
    if (refused := hops.refusal(request)) is not None:
        status, why = refused
        app[METRICS].refused("loop" if status == 508 else "header")
        return error(status, why, "LoopDetected" if status == 508 else "BadRequestError")
    count[0] += 1
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except Refused as exc:
        return exc.response
    finally:
        count[0] -= 1


def upstream_headers(request: web.Request) -> dict[str, str]:
    """What every call the router makes upstream for `request` carries: the client's
    ``Authorization`` (checked by `guard`), the routers it went through (`hops`)."""
    auth = request.headers.get("Authorization")
    return {**({"Authorization": auth} if auth is not None else {}), **hops.outgoing(request)}


def _plain(value: str) -> bool:
    """Printable ASCII, spaces and tabs: the same bytes in every charset."""
    return value.isascii() and all(c == "\t" or " " <= c <= "~" for c in value)


async def read_body(request: web.Request) -> bytes:
    """The request's body, within the router's size and time limits; raises `Refused`."""
    app = request.app
    cfg, metrics = app[CONFIG], app[METRICS]
    limit = cfg.max_body_bytes
    too_large = f"the body is over {limit} bytes"
    if request.content_length is not None and request.content_length > limit:
        metrics.refused("too_large")
        raise Refused(await _closing(request, error(413, too_large)))
    try:
        async with asyncio.timeout(cfg.body_timeout):
            return await request.read()
    except TimeoutError:
        metrics.refused("body_timeout")
        why = f"the request body did not arrive within {cfg.body_timeout:g}s"
        raise Refused(await _closing(request, error(408, why, "RequestTimeout"))) from None
    except web.HTTPRequestEntityTooLarge:  # a chunked body over client_max_size
        metrics.refused("too_large")
        raise Refused(await _closing(request, error(413, too_large))) from None


async def _closing(request: web.Request, resp: web.Response) -> web.Response:
    """`resp` sent, then the connection closed: the rest of the body is not read, so the
    connection cannot carry another request, and aiohttp would otherwise go on reading
    (and discarding) it for a while, a slow sender's connection held all that time."""
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    if request.transport is not None:
        request.transport.close()
    return resp


NOT_JSON = object()  # what `parse` returns for a body that is not JSON


def parse(request: web.Request, raw: bytes) -> Any:
    """The body's JSON value (what ``json.loads`` reads), or `NOT_JSON`; raises `Refused`
    (400) for a body that nests deeper than `MAX_DEPTH`."""
    try:
        value = jsonbody.parse(raw)
    except RecursionError:
        value = None
        deep = True
    except ValueError:  # not JSON, not UTF-8, or an integer of over 4,300 digits
        return NOT_JSON
    else:
        deep = too_deep(value, raw)
    if deep:
        request.app[METRICS].refused("too_deep")
        raise Refused(error(400, f"the body's JSON nests deeper than {MAX_DEPTH} levels"))
    return value


def too_deep(value: Any, raw: bytes = b"") -> bool:
    """Whether `value` nests lists and objects deeper than `MAX_DEPTH`. `raw` (its JSON
    text), when given, spares the walk for the usual body: it cannot nest deeper than it
    has brackets."""
    if raw and raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
