"""The router's admin endpoints: see and change the pools without a restart.

- ``GET /admin/instances``: every instance and what the router knows of it;
- ``POST /admin/instances`` ``{"role", "url", "side_channel"?, "drain"?}``: add one (or
  update the one at that URL);
- ``DELETE /admin/instances`` ``{"role", "url"}``: remove one (its requests finish);
- ``POST /admin/drain`` ``{"role", "url", "drain": true|false}``: drain one (no new
  requests; those in flight finish; its ``in_flight`` shows when it is idle) or undo it;
- ``POST /admin/reload``: re-read the config file now.

Whoever can change the pools can send every prompt to a server of their own, so:

- with ``--admin-token`` set they require ``Authorization: Bearer <token>`` (compared in
  constant time), from any client, loopback included (401 without it);
- without a token they are off (403), unless ``--admin-loopback-without-token`` opens
  them to clients on this host (loopback) that name it by an IP address or
  ``localhost`` (a page of another site that rebinds its name to 127.0.0.1 names it
  by that site's name);
- a request carrying an ``Origin`` (a browser's) that is not the router's own is refused
  (403): a page of another site may not use the admin endpoints, token or not;
- a request with a body (POST, DELETE) must send it as ``Content-Type:
  application/json`` (415): a page can send a form or text/plain anywhere, JSON only
  after a CORS preflight, which the router never approves.

Bad input gets HTTP 400 with the reason and changes nothing.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

from aiohttp import web

from kvpush.router import boundary, upkeep
from kvpush.router.config import CONFIG, POOL
from kvpush.router.pool import ROLES, Role, parse_spec


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/instances", _list)
    app.router.add_post("/admin/instances", _add)
    app.router.add_delete("/admin/instances", _remove)
    app.router.add_post("/admin/drain", _drain)
    app.router.add_post("/admin/reload", _reload)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class _Bad(Exception):
    pass


def refusal(request: web.Request) -> web.Response | None:
    """Why this admin request may not go on (401 / 403 / 415), or None when it may."""
    cfg = request.app[CONFIG]
    origin = request.headers.get("Origin")
    if origin is not None and origin.lower() != f"{request.scheme}://{request.host}".lower():
        return _error(403, "cross-origin requests may not use the admin endpoints")
    if cfg.admin_token is not None:
        if not _token_ok(request.headers.get("Authorization"), cfg.admin_token):
            return _error(401, "admin endpoints need Authorization: Bearer <admin token>")
    elif not cfg.admin_loopback_open:
        return _error(403, "the admin endpoints are off: start the router with --admin-token")
    elif not (_loopback(request.remote) and _local_name(request.host)):
        why = "without --admin-token the admin endpoints answer only loopback clients"
        return _error(403, why)
    if request.method not in ("GET", "HEAD"):
        ctype = request.headers.get("Content-Type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            return _error(415, "admin requests send their body as Content-Type: application/json")
    return None


def _token_ok(header: str | None, token: str) -> bool:
    # Bytes: compare_digest takes str only when ASCII, and a header may be anything.
    got = (header or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def _loopback(remote: str | None) -> bool:
    try:
        addr = ipaddress.ip_address((remote or "").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _local_name(host: str) -> bool:
    """Whether a Host header names this host as loopback clients do: an IP address or
    localhost (with or without a port)."""
    name = host.lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")]
    elif name.count(":") == 1:  # name:port
        name = name.split(":", 1)[0]
    if name == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


async def _body(request: web.Request) -> dict[str, Any]:
    body = boundary.parse(request, await boundary.read_body(request))
    if body is boundary.NOT_JSON:
        raise _Bad("body is not JSON")
    if not isinstance(body, dict):
        raise _Bad("expected a JSON object")
    return body


def _role(body: dict[str, Any]) -> Role:
    role = body.get("role")
    if role not in ROLES:
        raise _Bad(f'role must be "prefill" or "decode", got {role!r}')
    return role  # type: ignore[no-any-return]


def _listing(request: web.Request) -> web.Response:
    return web.json_response({"instances": [i.describe() for i in request.app[POOL].all()]})


async def _guarded(request: web.Request, action: Any) -> web.Response:
    refused = refusal(request)
    if refused is not None:
        return refused
    try:
        return await action(request)  # type: ignore[no-any-return]
    except boundary.Refused as exc:
        return exc.response
    except _Bad as exc:
        return _error(400, str(exc))
    except ValueError as exc:
        return _error(400, str(exc))


async def _list(request: web.Request) -> web.Response:
    async def act(request: web.Request) -> web.Response:
        return _listing(request)

    return await _guarded(request, act)


async def _add(request: web.Request) -> web.Response:
    async def act(request: web.Request) -> web.Response:
        body = await _body(request)
        role = _role(body)
        spec = parse_spec(role, {k: v for k, v in body.items() if k != "role"})
        request.app[POOL].add(spec)
        return _listing(request)

    return await _guarded(request, act)


async def _remove(request: web.Request) -> web.Response:
    async def act(request: web.Request) -> web.Response:
        body = await _body(request)
        role, url = _role(body), str(body.get("url", "")).rstrip("/")
        if request.app[POOL].remove(role, url) is None:
            return _error(404, f"no {role} instance {url!r}")
        return _listing(request)

    return await _guarded(request, act)


async def _drain(request: web.Request) -> web.Response:
    async def act(request: web.Request) -> web.Response:
        body = await _body(request)
        role, url = _role(body), str(body.get("url", "")).rstrip("/")
        drain = body.get("drain", True)
        if not isinstance(drain, bool):
            raise _Bad("drain must be true or false")
        inst = request.app[POOL].get(role, url)
        if inst is None:
            return _error(404, f"no {role} instance {url!r}")
        inst.draining = drain
        return web.json_response(inst.describe())

    return await _guarded(request, act)


async def _reload(request: web.Request) -> web.Response:
    async def act(request: web.Request) -> web.Response:
        if not request.app[CONFIG].config_path:
            raise _Bad("the router was started without --config")
        try:
            upkeep.load_config(request.app)
        except OSError as exc:
            raise _Bad(f"config file not read: {exc}") from None
        return _listing(request)

    return await _guarded(request, act)
