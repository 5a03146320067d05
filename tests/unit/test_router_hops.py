"""Loop detection (`kvpush.router.hops`), over real HTTP: a router added as its own
decoder answers the loop with 508 at the first hop instead of calling itself until its
concurrency cap is spent, and a client's own header is checked like any input."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router import hops
from tests.unit.test_router import DEADLINE, completion_body, running

AUTH = {"Authorization": "Bearer s3cret"}
OTHER = "0123456789abcdef0123456789abcdef"  # another router's id


class Stub:
    """An upstream that records each call's `hops.HEADER` and answers as vLLM."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.via: list[str | None] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.post)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        self.via.append(request.headers.get(hops.HEADER))
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def post(self, request: web.Request) -> web.StreamResponse:
        self.via.append(request.headers.get(hops.HEADER))
        body = await request.json()
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            piece = {"choices": [{"index": 0, "text": self.name, "finish_reason": "length"}]}
            await resp.write(b"data: " + json.dumps(piece).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        return web.json_response({"choices": [{"text": self.name}]})


async def metric(cl: aiohttp.ClientSession, url: str, line: str) -> float:
    async with cl.get(url + "/metrics") as resp:
        for got in (await resp.text()).splitlines():
            if got.startswith(line + " "):
                return float(got.split()[-1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_router_added_as_its_own_decoder_fails_fast_instead_of_looping(stream: bool) -> None:
    p, d = Stub("P"), Stub("D")

    async def main() -> None:
        settings: dict[str, Any] = {"admin_token": "s3cret", "max_concurrent": 8, "retries": 0}
        async with running(p.app(), d.app(), **settings) as (url, cl):
            body = {"role": "decode", "url": url}
            async with cl.post(url + "/admin/instances", json=body, headers=AUTH) as resp:
                assert resp.status == 200
            async with cl.get(url + "/admin/instances", headers=AUTH) as resp:
                real_d = next(
                    i["url"]
                    for i in (await resp.json())["instances"]
                    if i["role"] == "decode" and i["url"] != url
                )
            body = {"role": "decode", "url": real_d}
            async with cl.delete(url + "/admin/instances", json=body, headers=AUTH) as resp:
                assert resp.status == 200
            # More requests than the cap: each loop ends at its first hop, so none is
            # refused as busy, and each fails alone, fast.
            statuses = []
            async with asyncio.timeout(DEADLINE):
                for _ in range(12):
                    req = {**completion_body(), "stream": stream}
                    async with cl.post(url + "/v1/completions", json=req) as resp:
                        await resp.read()
                        statuses.append(resp.status)
            # Each a 502 (the looping decoder's failure; the loop's own 508 is in the
            # body), counted against that instance; never a 200 from the loop.
            assert statuses == [502] * 12, statuses
            assert 'reason="busy"' not in await _metrics(cl, url)
            loops = await metric(cl, url, 'kvpush_router_refused_total{reason="loop"}')
            assert loops >= 12  # and the router's own asks of the decoder's /v1/models
            async with cl.get(url + "/admin/instances", headers=AUTH) as resp:
                me = [i for i in (await resp.json())["instances"] if i["url"] == url]
            assert me[0]["breaker"] == "open"
            async with cl.get(url + "/v1/models") as resp:
                assert resp.status == 508
                assert "came back to this router" in (await resp.json())["error"]["message"]
            # The real decoder back: served again.
            body = {"role": "decode", "url": real_d}
            async with cl.post(url + "/admin/instances", json=body, headers=AUTH) as resp:
                assert resp.status == 200
            async with cl.delete(
                url + "/admin/instances", json={"role": "decode", "url": url}, headers=AUTH
            ) as resp:
                assert resp.status == 200
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"] == "D"

    asyncio.run(main())


async def _metrics(cl: aiohttp.ClientSession, url: str) -> str:
    async with cl.get(url + "/metrics") as resp:
        return await resp.text()


def test_every_upstream_call_names_the_routers_it_went_through() -> None:
    p, d = Stub("P"), Stub("D")

    async def main() -> None:
        async with running(p.app(), d.app()) as (url, cl):
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200
            mine = p.via[-1]
            assert mine is not None and len(mine) == 32 and d.via[-1] == mine
            head = {hops.HEADER: OTHER}
            async with cl.post(url + "/v1/completions", json=completion_body(), headers=head):
                pass
            assert p.via[-1] == d.via[-1] == f"{OTHER}, {mine}"
            async with cl.get(url + "/v1/models", headers=head) as resp:
                assert resp.status == 200
            assert d.via[-1] == f"{OTHER}, {mine}"

    asyncio.run(main())


@pytest.mark.parametrize(
    ("value", "status"),
    [
        ("x", 400),
        (OTHER + ",", 400),  # an empty id
        (OTHER + "\u00e9", 400),
        ("[" + OTHER + "]", 400),
        (", ".join([OTHER] * (hops.MAX_HOPS - 1)), 200),
        (", ".join([OTHER] * hops.MAX_HOPS), 508),
        ("," * 4000, 508),  # long: refused before it is split
    ],
)
def test_a_clients_own_via_header_is_checked(value: str, status: int) -> None:
    p, d = Stub("P"), Stub("D")

    async def main() -> None:
        async with running(p.app(), d.app()) as (url, cl):
            head = {hops.HEADER: value}
            async with cl.post(url + "/v1/completions", json=completion_body(), headers=head) as r:
                assert r.status == status, await r.text()
            if status != 200:
                assert p.via == [] and d.via == []  # refused before any upstream

    asyncio.run(main())
