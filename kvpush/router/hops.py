"""Loop detection: a router that reaches itself through its own instances.

An operator who adds the router (or another router that leads back to it) as one of its
instances makes every client request call itself again and again until the router's
concurrency cap is spent (each hop holds a connection). Every call the router makes
upstream carries `HEADER`, the ids of the routers the request went through, its own
last; a client request that names this router, or more than `MAX_HOPS` routers, is
refused with 508 before its body is read. The looping leg then fails as its upstream's
failure (5xx): the misconfigured instance's breaker opens, and the client gets 502.
"""

from __future__ import annotations

import uuid

from aiohttp import web

HEADER = "X-Kvpush-Via"
# More routers than any sane chain (a router in front of routers): a loop through other
# routers, which do not forward each other's ids unchanged, ends here at the latest.
MAX_HOPS = 8
_ID_CHARS = 32  # uuid4().hex
_SELF: web.AppKey[str] = web.AppKey("router_id")


def install(app: web.Application) -> None:
    app[_SELF] = uuid.uuid4().hex


def refusal(request: web.Request) -> tuple[int, str] | None:
    """The status and reason `request` is refused with (508: a loop; 400: a header that
    is not a list of router ids), or None."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    too_many = (508, f"header {HEADER}: the request went through {MAX_HOPS} routers or more")
    if len(value) > MAX_HOPS * (_ID_CHARS + 2):
        return too_many
    seen = [part.strip() for part in value.split(",")]
    if not all(len(s) == _ID_CHARS and s.isascii() and s.isalnum() for s in seen):
        return 400, f"header {HEADER}: not a list of router ids"
    if request.app[_SELF] in seen:
        return 508, "the request came back to this router: an instance leads to the router itself"
    if len(seen) >= MAX_HOPS:
        return too_many
    return None


def outgoing(request: web.Request) -> dict[str, str]:
    """The header every upstream call made for `request` carries: the routers it went
    through (already checked by `refusal`), and this one."""
    value = request.headers.get(HEADER)
    own = request.app[_SELF]
    return {HEADER: f"{value}, {own}" if value else own}
