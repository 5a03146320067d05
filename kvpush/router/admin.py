"""The router's admin endpoints: see and change the pools without a restart.

- ``GET /admin/instances``: every instance and what the router knows of it;
- ``POST /admin/instances`` ``{"role", "url", "side_channel"?, "drain"?}``: add one (or
  update the one at that URL);
- ``DELETE /admin/instances`` ``{"role", "url"}``: remove one (its requests finish);
- ``POST /admin/drain`` ``{"role", "url", "drain": true|false}``: drain one (no new
  requests; those in flight finish; its ``in_flight`` shows when it is idle) or undo it;
- ``POST /admin/reload``: re-read the config file now.

With ``--admin-token`` set they require ``Authorization: Bearer <token>``; without one they
answer only clients on this host (loopback): whoever can change the pools can send every
prompt to a server of their own. Bad input gets HTTP 400 with the reason and changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from kvpush.router import upkeep
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


_LOOPBACK = ("127.", "::1", "::ffff:127.")


def refusal(request: web.Request) -> web.Response | None:
    """Why this admin request may not go on (401 / 403), or None when it may."""
    token = request.app[CONFIG].admin_token
    if token is not None:
        if request.headers.get("Authorization") == f"Bearer {token}":
            return None
        return _error(401, "admin endpoints need Authorization: Bearer <admin token>")
    if (request.remote or "").startswith(_LOOPBACK):
        return None
    return _error(403, "without --admin-token the admin endpoints answer only loopback clients")


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _Bad(f"body is not JSON: {exc}") from None
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
