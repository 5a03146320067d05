"""The router's boundary with its clients (issue 37), over real HTTP against recording
stub upstreams: no client-supplied kv_transfer_params reaches any upstream on any path,
and what the router answers itself (bad headers, bodies, too many requests) reaches no
upstream and moves no breaker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router import RouterConfig, make_app
from kvpush.router.pool import InstanceSpec
from tests.unit.test_router import DEADLINE, SIDE_CHANNEL, completion_body, running, serve
from tests.unit.test_router_head import DONE, answers_twice, streams_one_token, text_event

# What a hostile client sends: D would connect to this address and wait for KV.
HOSTILE = {
    "do_remote_prefill": True,
    "remote_host": "127.0.0.1",
    "remote_port": 9,
    "remote_tp_size": 8,
    "transfer_id": "mine",
}
# vLLM reads kv_transfer_params from vllm_xargs too when the body has none of its own.
XARGS = {"kv_transfer_params": "x", "keep": 1}
KV = "kv_transfer_params"
# What vLLM's extra args take (so vLLM would read them as the connector's orders).
XARG_VALUES: list[Any] = ["x", 3, 2.5, True, [], ["a", 1, 2.5, False]]


def hostile(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": HOSTILE, "vllm_xargs": XARGS}


def assert_routers_own(body: dict[str, Any], want: dict[str, Any] | None) -> None:
    """The leg carries the router's kv_transfer_params (`want`: None for none at all),
    and nothing of the client's."""
    assert body.get("kv_transfer_params") == want, body
    assert body.get("vllm_xargs") == {"keep": 1}, body


class Recorder:
    """A stub upstream that records every POST body and answers like a unary vLLM."""

    def __init__(self, name: str, fail_first: list[int] | None = None) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        self.health_calls = 0
        # Shared by the instances of a test: the first POSTs among them fail (HTTP 500).
        self.fail_first = fail_first

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.post)
        app.router.add_post("/v1/chat/completions", self.post)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        return web.json_response({})

    async def post(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.content_types.append(request.headers.get("Content-Type", "(none)"))
        if self.fail_first is not None and self.fail_first[0] > 0:
            self.fail_first[0] -= 1
            return web.json_response({"error": "down"}, status=500)
        return web.json_response({"choices": [{"text": self.name}]})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_split_legs_carry_only_the_routers_kv_transfer_params(path: str) -> None:
    p, d = Recorder("P"), Recorder("D")
    body = completion_body()
    if "chat" in path:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def main() -> None:
        async with running(p.app(), d.app()) as (url, cl):
            async with cl.post(url + path, json=hostile(body)) as resp:
                assert resp.status == 200, await resp.text()
                tid = resp.headers["X-Request-Id"]
        assert_routers_own(p.bodies[0], {"do_remote_decode": True, "transfer_id": tid})
        host, port = SIDE_CHANNEL
        mine = {"do_remote_prefill": True, "transfer_id": tid, "remote_host": host}
        assert_routers_own(d.bodies[0], {**mine, "remote_port": port})

    asyncio.run(main())


@pytest.mark.parametrize(
    "extra",
    [{"logprob_token_ids": []}, {"prompt_logprobs": 1}, {"use_beam_search": True, "n": 2}],
    ids=["logprob_token_ids", "prompt_logprobs", "beam_search"],
)
def test_the_decoder_alone_gets_no_kv_transfer_params_of_the_client(extra: dict[str, Any]) -> None:
    p, d = Recorder("P"), Recorder("D")

    async def main() -> None:
        async with running(p.app(), d.app()) as (url, cl):
            body = hostile({**completion_body(), **extra})
            async with cl.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        assert p.bodies == []
        assert_routers_own(d.bodies[0], None)
        assert {k: v for k, v in d.bodies[0].items() if k != "vllm_xargs"} == {
            **completion_body(),
            **extra,
        }

    asyncio.run(main())


def test_a_retry_on_another_pair_carries_only_the_routers_kv_transfer_params() -> None:
    failing = [1]  # the first prefill leg fails: the request goes again on the other pair
    ps = [Recorder(f"p{i}", failing) for i in range(2)]
    ds = [Recorder(f"d{i}") for i in range(2)]

    async def main() -> None:
        runners, specs = [], []
        for role, recs in (("prefill", ps), ("decode", ds)):
            for i, rec in enumerate(recs):
                runner, u = await serve(rec.app(), handler_cancellation=True)
                runners.append(runner)
                side = ("127.0.0.1", 5600 + i) if role == "prefill" else None
                specs.append(InstanceSpec(role, u, side))  # type: ignore[arg-type]
        cfg = RouterConfig(instances=tuple(specs), timeout=DEADLINE, retries=1)
        router, url = await serve(make_app(cfg), handler_cancellation=True)
        try:
            async with aiohttp.ClientSession() as cl:
                async with cl.post(url + "/v1/completions", json=hostile(completion_body())) as r:
                    assert r.status == 200, await r.text()
                    tid = r.headers["X-Request-Id"]
        finally:
            for runner in [router, *runners]:
                await runner.cleanup()
        p_bodies = [b for rec in ps for b in rec.bodies]
        assert len(p_bodies) == 2 and failing == [0]  # tried twice
        last = [b for b in p_bodies if b["kv_transfer_params"]["transfer_id"] == tid]
        assert len(last) == 1  # the try that served the client
        assert_routers_own(last[0], {"do_remote_decode": True, "transfer_id": tid})
        for b in [*p_bodies, *(b for rec in ds for b in rec.bodies)]:
            params = b["kv_transfer_params"]
            assert params.get("remote_port") != 9 and params["transfer_id"] != "mine", b
            assert b["vllm_xargs"] == {"keep": 1}, b

    asyncio.run(main())


def test_ps_first_token_leg_and_ds_recomputation_carry_none_of_the_clients() -> None:
    """A streamed greedy request: P's leg streams the first token (kvpush.router.head);
    D's first token differs, and D is asked for the request again without P's KV."""
    seen_p: dict[str, Any] = {}
    seen_d: list[dict[str, Any]] = []
    decode, client_has_first = answers_twice((" a", " the"), seen_d)
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "temperature": 0}

    async def main() -> list[bytes]:
        events = []
        p_app, d_app = web.Application(), web.Application()
        p_app.router.add_post("/v1/completions", streams_one_token(seen_p))
        d_app.router.add_post("/v1/completions", decode)
        async with running(p_app, d_app) as (url, cl):
            async with cl.post(url + "/v1/completions", json=hostile(body)) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line + b"\n")
                        client_has_first.set()
        return events

    events = asyncio.run(main())
    assert events == [text_event(" the"), text_event(" dog"), text_event(".", "length"), DONE]
    seen_p = seen_p["p"]
    assert seen_p["stream"] is True  # P's first-token leg
    assert seen_p["kv_transfer_params"]["do_remote_decode"] is True
    assert seen_p["kv_transfer_params"]["transfer_id"] != "mine"
    assert seen_p["vllm_xargs"] == {"keep": 1}
    assert len(seen_d) == 2
    assert seen_d[0]["kv_transfer_params"]["remote_port"] == SIDE_CHANNEL[1]
    assert_routers_own(seen_d[1], None)  # the re-computation: no KV expected at all


# --- what the router answers itself ------------------------------------------------------


async def raw_request(url: str, data: bytes, read_timeout: float = DEADLINE) -> bytes:
    """Send `data` as it is on a new connection; everything the router sends back
    before it closes the connection (or `read_timeout` passes)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        async with asyncio.timeout(read_timeout):
            while chunk := await reader.read(65536):
                out += chunk
        return out
    finally:
        writer.close()


def post_bytes(body: bytes, headers: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + headers
        + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )


@asynccontextmanager
async def routed(
    **settings: Any,
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, Recorder, Recorder]]:
    p, d = Recorder("P"), Recorder("D")
    async with running(p.app(), d.app(), **settings) as (url, cl):
        yield url, cl, p, d


async def breakers(cl: aiohttp.ClientSession, url: str) -> list[tuple[str, bool]]:
    auth = {"Authorization": "Bearer s3cret"}
    async with cl.get(url + "/admin/instances", headers=auth) as resp:
        assert resp.status == 200
        return [(i["breaker"], i["available"]) for i in (await resp.json())["instances"]]


def test_a_header_that_is_not_ascii_is_a_400_that_counts_against_nobody() -> None:
    async def main() -> None:
        async with routed(admin_token="s3cret") as (url, cl, p, d):
            body = json.dumps(completion_body()).encode()
            # UTF-8 beyond Latin-1 and within it, bytes that are not UTF-8, Latin-1.
            for value in ("Bearer €".encode(), "Bearer é".encode(), b"\xff\xfe", b"\xe9"):
                for _ in range(4):  # more than the breaker's 3 failures
                    data = post_bytes(body, b"Authorization: " + value + b"\r\n")
                    got = await raw_request(url, data)
                    assert got.startswith(b"HTTP/1.1 400"), got[:200]
                    assert b"not printable ASCII" in got
            assert p.bodies == [] and d.bodies == []
            assert await breakers(cl, url) == [("closed", True), ("closed", True)]
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200

    asyncio.run(main())


@pytest.mark.parametrize("depth", [100, 600, 5000])
def test_json_nested_too_deep_is_a_400_before_any_upstream(depth: int) -> None:
    async def main() -> None:
        async with routed() as (url, cl, p, d):
            junk = b"[" * depth + b"]" * depth
            body = b'{"model": "m", "prompt": "x", "max_tokens": 2, "junk": ' + junk + b"}"
            async with cl.post(url + "/v1/completions", data=body, headers=JSON) as resp:
                status, answer = resp.status, await resp.json()
            if depth <= 512:
                assert status == 200 and len(d.bodies) == 1
                return
            assert status == 400, answer
            assert "nests deeper" in answer["error"]["message"]
            assert p.bodies == [] and d.bodies == []

    asyncio.run(main())


JSON = {"Content-Type": "application/json"}


def test_a_body_over_the_limit_is_a_413_before_any_upstream() -> None:
    async def main() -> None:
        async with routed(max_body_bytes=1000) as (url, cl, p, d):
            big = {**completion_body(), "prompt": "x" * 2000}
            async with cl.post(url + "/v1/completions", json=big) as resp:
                assert resp.status == 413

            # Sent chunked, without a length: the limit holds while reading.
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(4):
                    yield b" " * 400
                yield json.dumps(completion_body()).encode()

            async with cl.post(url + "/v1/completions", data=chunks(), headers=JSON) as resp:
                assert resp.status == 413
            assert p.bodies == [] and d.bodies == []
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200

    asyncio.run(main())


def test_a_slow_body_gets_408_and_its_connection_closed() -> None:
    async def main() -> None:
        async with routed(body_timeout=0.3) as (url, cl, p, d):
            head = post_bytes(b"x" * 100)[:-90]  # 10 of the 100 bytes announced
            loop = asyncio.get_running_loop()
            start = loop.time()
            got = await raw_request(url, head, read_timeout=DEADLINE)  # ends: closed
            assert got.startswith(b"HTTP/1.1 408"), got[:200]
            assert loop.time() - start < DEADLINE
            assert p.bodies == [] and d.bodies == []

    asyncio.run(main())


def test_requests_beyond_the_cap_get_503_with_retry_after() -> None:
    release = asyncio.Event()
    arrived: list[int] = []

    async def decode(request: web.Request) -> web.Response:
        await request.read()
        arrived.append(1)
        await asyncio.wait_for(release.wait(), DEADLINE)
        return web.json_response({"choices": [{"text": "D"}]})

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"choices": [{"text": "P"}]})

    p_app, d_app = web.Application(), web.Application()
    p_app.router.add_post("/v1/completions", prefill)
    d_app.router.add_post("/v1/completions", decode)

    async def main() -> None:
        async with running(p_app, d_app, max_concurrent=2) as (url, cl):

            async def one() -> int:
                async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                    await resp.read()
                    return resp.status

            held = [asyncio.create_task(one()) for _ in range(2)]
            async with asyncio.timeout(DEADLINE):
                while len(arrived) < 2:
                    await asyncio.sleep(0.01)
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == 503
            async with cl.get(url + "/metrics") as resp:  # not a client request: served
                assert 'kvpush_router_refused_total{reason="busy"} 1.0' in await resp.text()
            release.set()
            assert await asyncio.gather(*held) == [200, 200]
            assert await one() == 200

    asyncio.run(main())


def test_health_tells_an_anonymous_caller_only_that_the_router_is_up() -> None:
    async def main() -> None:
        # No probe loop during the test: what /health asks upstream shows by itself.
        async with routed(admin_token="s3cret", health_interval=60.0) as (url, cl, p, d):
            async with asyncio.timeout(DEADLINE):
                while not (p.health_calls and d.health_calls):  # the loop's first round
                    await asyncio.sleep(0.01)
            before = (p.health_calls, d.health_calls)
            for _ in range(5):
                async with cl.get(url + "/health") as resp:
                    assert resp.status == 200
                    assert await resp.json() == {"status": "ok"}
            assert (p.health_calls, d.health_calls) == before
            auth = {"Authorization": "Bearer s3cret"}
            async with cl.get(url + "/health", headers=auth) as resp:
                detail = await resp.json()
            assert detail["prefill"]["instances"][0]["side_channel"] == "127.0.0.1:5600"

    asyncio.run(main())


def test_the_admin_endpoints_are_off_without_a_token() -> None:
    async def main() -> None:
        async with routed() as (url, cl, _, _):
            async with cl.get(url + "/admin/instances") as resp:
                assert resp.status == 403
            async with cl.post(url + "/admin/drain", json={"role": "decode", "url": "x"}) as r:
                assert r.status == 403

    asyncio.run(main())


def test_the_clients_authorization_goes_to_ds_models() -> None:
    """Behind vLLM's --api-key: the router's pre-check of max_tokens against D's context
    (asked on D's /v1/models) works with the client's key, and so does /v1/models."""
    p = Recorder("P")
    d = Recorder("D")
    asked: list[str | None] = []

    async def models(request: web.Request) -> web.Response:
        asked.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    d_app = d.app()
    d_app.router.add_get("/v1/models", models)

    async def main() -> None:
        async with running(p.app(), d_app) as (url, cl):
            key = {"Authorization": "Bearer k"}
            async with cl.get(url + "/v1/models", headers=key) as resp:
                assert resp.status == 200
            body = {**completion_body(), "max_tokens": 500}  # beyond D's context
            async with cl.post(url + "/v1/completions", json=body, headers=key) as resp:
                assert resp.status == 200
        # Over D's context: D alone answers (here, the stub: as vLLM would refuse it),
        # P prefilled nothing.
        assert p.bodies == [] and len(d.bodies) == 1
        assert asked and all(a == "Bearer k" for a in asked)

    asyncio.run(main())


@pytest.mark.parametrize("ctype", ["text/plain", "", None])
def test_a_body_not_sent_as_json_goes_to_the_decoder_alone(ctype: str | None) -> None:
    """vLLM reads only a JSON content type as JSON (none is no JSON either): D refuses
    the rest as a plain server does; the router does not read it as JSON for P."""

    async def main() -> None:
        async with routed() as (url, _, p, d):
            data = json.dumps(hostile(completion_body())).encode()
            headers = "" if ctype is None else f"Content-Type: {ctype}\r\n"
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            head += headers.encode() + b"Content-Length: %d\r\n\r\n" % len(data)
            got = await raw_request(url, head + data)
            assert got.startswith(b"HTTP/1.1 200"), got[:300]
        assert p.bodies == [] and len(d.bodies) == 1
        assert_routers_own(d.bodies[0], None)
        assert d.content_types == [ctype or ""]

    asyncio.run(main())


@pytest.mark.parametrize(
    "extra",
    [
        {"kv_transfer_params": "x"},
        {"kv_transfer_params": [1, 2]},
        {"kv_transfer_params": 3},
        {"kv_transfer_params": True},
        # vLLM's extra args take strings, numbers and lists of them, nothing else.
        {"vllm_xargs": {"kv_transfer_params": HOSTILE}},
        {"vllm_xargs": {"kv_transfer_params": None}},
        {"vllm_xargs": {"kv_transfer_params": [HOSTILE]}},
        {"vllm_xargs": {"kv_transfer_params": [[1]]}},
        {"kv_transfer_params": HOSTILE, "vllm_xargs": {"kv_transfer_params": {}}},
    ],
)
def test_params_vllm_refuses_go_to_the_decoder_as_sent_for_vllms_own_400(
    extra: dict[str, Any],
) -> None:
    """Dropping them would serve a request a plain server refuses (a red-team run: 200
    where vLLM answers 400); vLLM's schema refuses them before anything acts on them."""

    async def main() -> None:
        async with routed() as (url, cl, p, d):
            body = {**completion_body(), **extra}
            async with cl.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200  # the stub's answer: D's, whatever it is
            assert p.bodies == [] and d.bodies == [body]
            async with cl.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvpush_router_decoder_alone_total{reason="bad_kv_transfer_params"} 1.0' in text

    asyncio.run(main())


@pytest.mark.parametrize(
    "extra",
    [
        {"kv_transfer_params": None},
        {"kv_transfer_params": HOSTILE},
        *({"vllm_xargs": {"kv_transfer_params": v, "keep": 1}} for v in XARG_VALUES),
    ],
)
def test_params_vllm_takes_are_dropped(extra: dict[str, Any]) -> None:
    async def main() -> None:
        async with routed() as (url, cl, p, d):
            body = {**completion_body(), **extra}
            async with cl.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            for leg in (p.bodies[0], d.bodies[0]):
                assert leg["kv_transfer_params"]["transfer_id"] != HOSTILE["transfer_id"]
                assert KV not in leg.get("vllm_xargs", {})
            assert p.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True

    asyncio.run(main())


def test_untrusted_leaves_the_clients_body_as_it_was() -> None:
    from kvpush.router import bodies, boundary

    body = hostile(completion_body())
    clean = bodies.untrusted(body)
    assert "kv_transfer_params" not in clean and clean["vllm_xargs"] == {"keep": 1}
    assert body == hostile(completion_body())  # a copy: the original is untouched
    plain = completion_body()
    assert bodies.untrusted(plain) is plain  # nothing to drop: no copy
    deep: Any = []
    for _ in range(boundary.MAX_DEPTH - 1):
        deep = [deep]
    assert not boundary.too_deep({"a": 1, "b": deep[0]})
    assert boundary.too_deep({"a": deep})
