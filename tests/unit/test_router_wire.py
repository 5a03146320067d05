"""The router's upstream HTTP/1.1 client (kvpush/router/wire.py): connection reuse,
bodies ended by length, chunks or the close, and upstreams that break off."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from kvpush.router import wire

DEADLINE = 10.0


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def raw_server(reply: bytes, close: bool) -> tuple[asyncio.Server, str]:
    """Answers every request with `reply`, then closes the connection if `close`."""

    class Once(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(reply)  # type: ignore[attr-defined]
            if close:
                self.transport.close()

    server = await asyncio.get_running_loop().create_server(Once, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_streams_and_answers_reuse_one_kept_alive_connection() -> None:
    peers: set[Any] = set()
    seen: list[tuple[str, str, bytes]] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        seen.append((request.headers["X-Request-Id"], request.content_type, await request.read()))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def unary(request: web.Request) -> web.Response:
        peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        return web.json_response({"ok": True}, status=201)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/s", stream)
        app.router.add_post("/u", unary)
        runner, url = await serve(app)
        up = wire.Upstreams()
        try:
            async with asyncio.timeout(DEADLINE):
                for n in range(3):
                    body, rid = b'{"n": %d}' % n, {"X-Request-Id": str(n)}
                    resp = await up.post(url + "/s", body, rid, "application/json")
                    assert resp.status == 200
                    assert resp.headers["content-type"] == "text/event-stream"
                    assert await resp.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
                    resp.release()
                    resp = await up.post(url + "/u", b"{}", {}, "application/json")
                    assert (resp.status, await resp.read()) == (201, b'{"ok": true}')
                    resp.release()
            assert len(up) == 1
        finally:
            up.close()
            await runner.cleanup()
        assert len(peers) == 1, peers
        assert seen == [(str(n), "application/json", b'{"n": %d}' % n) for n in range(3)]

    asyncio.run(main())


def test_an_unfinished_or_stale_response_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    peers: list[Any] = []

    async def unary(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        return web.Response(body=b"x" * 100_000)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/u", unary)
        runner, url = await serve(app)
        up = wire.Upstreams()
        try:
            async with asyncio.timeout(DEADLINE):
                resp = await up.post(url + "/u", b"", {}, "text/plain")
                resp.release()  # before its body: the connection cannot take another
                resp = await up.post(url + "/u", b"", {}, "text/plain")
                assert len(await resp.read()) == 100_000
                resp.release()
                monkeypatch.setattr(wire, "_IDLE_S", 0.0)  # now every idle one is stale
                resp = await up.post(url + "/u", b"", {}, "text/plain")
                await resp.read()
                resp.release()
        finally:
            up.close()
            await runner.cleanup()
        assert len(set(peers)) == 3, peers

    asyncio.run(main())


def test_bodies_that_end_with_the_connection_or_break_off() -> None:
    async def main() -> None:
        up = wire.Upstreams()
        try:
            async with asyncio.timeout(DEADLINE):
                # No length, not chunked: the body ends with the connection.
                server, url = await raw_server(b"HTTP/1.1 200 OK\r\n\r\nwhole body", True)
                resp = await up.post(url, b"", {}, "text/plain")
                assert await resp.read() == b"whole body"
                resp.release()
                server.close()
                # A length not reached before the close: what came, then an error.
                head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n"
                server, url = await raw_server(head + b"ten bytes!", True)
                resp = await up.post(url, b"", {}, "text/plain")
                assert await resp.readany() == b"ten bytes!"
                with pytest.raises(wire.UpstreamClosed, match="mid-response"):
                    await resp.readany()
                resp.close()
                server.close()
                # Closed before any header, and not HTTP at all.
                for reply in (b"", b"SMTP ready\r\n\r\n"):
                    server, url = await raw_server(reply, True)
                    with pytest.raises(wire.UpstreamClosed):
                        await up.post(url, b"", {}, "text/plain")
                    server.close()
                with pytest.raises(OSError):  # nobody listening there any more
                    await up.post(url, b"", {}, "text/plain")
            assert len(up) == 0
        finally:
            up.close()

    asyncio.run(main())


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="http"):
        wire.Target("ftp://host/x")
    t = wire.Target("http://[::1]:8000/v1/completions?x=1")
    assert t.head == b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: [::1]:8000\r\n"
