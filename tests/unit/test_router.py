"""The real router over real HTTP on 127.0.0.1, against stub upstreams started in the test.

Synchronisation is by events with deadlines, never by sleeping: a stub that needs the
other leg to have arrived waits for it, and fails its request if it does not come.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router import RouterConfig, make_app
from kvpush.router.bodies import decode_body, prefill_body
from kvpush.router.cli import parse_host_port

DEADLINE = 5.0  # how long a stub waits for the other leg before failing the test
SIDE_CHANNEL = ("127.0.0.1", 5600)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def stub(post: Handler, health: int = 200) -> web.Application:
    """An upstream that answers both OpenAI endpoints with `post`."""
    app = web.Application()
    app.router.add_post("/v1/completions", post)
    app.router.add_post("/v1/chat/completions", post)

    async def health_handler(request: web.Request) -> web.Response:
        return web.json_response({}, status=health)

    app.router.add_get("/health", health_handler)
    return app


async def serve(app: web.Application, **kwargs: Any) -> tuple[web.AppRunner, str]:
    # handler_cancellation: a stub handler sees CancelledError when the router hangs up,
    # which lets tests observe that the router cancelled a leg.
    runner = web.AppRunner(app, shutdown_timeout=1.0, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def dead_url() -> str:
    """A URL on a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@asynccontextmanager
async def running(
    prefill: web.Application | str,
    decode: web.Application | str,
    timeout: float = 10.0,
    **settings: Any,
) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    """Start the stubs and the router (`settings`: more of its RouterConfig); yield the
    router URL and a client session."""
    runners: list[web.AppRunner] = []
    urls = []
    for upstream in (prefill, decode):
        if isinstance(upstream, str):
            urls.append(upstream)
        else:
            runner, url = await serve(upstream, handler_cancellation=True)
            runners.append(runner)
            urls.append(url)
    config = RouterConfig(
        prefill_url=urls[0],
        decode_url=urls[1],
        timeout=timeout,
        prefill_side_channel=SIDE_CHANNEL,
        **settings,
    )
    # As `kvpush router` runs it: a client hang-up cancels the handler.
    router, router_url = await serve(make_app(config), handler_cancellation=True)
    runners.insert(0, router)
    try:
        async with aiohttp.ClientSession() as client:
            yield router_url, client
    finally:
        for runner in runners:
            await runner.cleanup()


async def ok_prefill(request: web.Request) -> web.Response:
    await request.json()
    return web.json_response({"choices": [{"text": "P"}]})


def completion_body(stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": stream}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_legs_are_concurrent_and_share_transfer_id(path: str) -> None:
    seen: dict[str, tuple[dict[str, Any], str]] = {}
    both_arrived = asyncio.Event()

    def make(name: str, text: str) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            seen[name] = (await request.json(), request.headers["X-Request-Id"])
            if len(seen) == 2:
                both_arrived.set()
            # Neither stub answers until both legs are in: sequential legs fail here.
            await asyncio.wait_for(both_arrived.wait(), DEADLINE)
            return web.json_response({"choices": [{"text": text}]})

        return handler

    body: dict[str, Any] = {"model": "m", "max_tokens": 8, "temperature": 0}
    if "chat" in path:
        body.update(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=8)
    else:
        body["prompt"] = "hello"

    async def main() -> None:
        async with running(stub(make("prefill", "P")), stub(make("decode", "D"))) as (url, cl):
            async with cl.post(url + path, json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["choices"][0]["text"] == "D"
                response_id = resp.headers["X-Request-Id"]
        (pbody, pid), (dbody, did) = seen["prefill"], seen["decode"]
        tid = pbody["kv_transfer_params"]["transfer_id"]
        assert len(tid) == 32 and all(c in "0123456789abcdef" for c in tid)
        assert pid == did == response_id == tid
        assert pbody["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
        assert dbody["kv_transfer_params"] == {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_host": SIDE_CHANNEL[0],
            "remote_port": SIDE_CHANNEL[1],
        }
        assert pbody["max_tokens"] == 1 and pbody["stream"] is False
        assert dbody["max_tokens"] == 8
        if "chat" in path:
            assert pbody["max_completion_tokens"] == 1 and dbody["max_completion_tokens"] == 8

    asyncio.run(main())


def test_stream_chunks_pass_through_in_order_as_they_arrive() -> None:
    n = 5
    acks = [asyncio.Event() for _ in range(n)]
    decode_seen: list[dict[str, Any]] = []

    async def decode(request: web.Request) -> web.StreamResponse:
        decode_seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            # The next chunk only goes once the client has this one: a router that
            # buffers the stream stalls here and the test fails at the deadline.
            await asyncio.wait_for(acks[i].wait(), DEADLINE)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> None:
        got: list[Any] = []
        async with running(stub(ok_prefill), stub(decode)) as (url, cl):
            async with asyncio.timeout(2 * DEADLINE):
                async with cl.post(url + "/v1/completions", json=completion_body(True)) as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    async for line in resp.content:
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:].strip()
                        if payload == b"[DONE]":
                            got.append("DONE")
                            continue
                        i = json.loads(payload)["i"]
                        got.append(i)
                        acks[i].set()
        assert got == [*range(n), "DONE"]
        assert decode_seen[0]["stream"] is True

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_500_gives_502_and_cancels_decode(stream: bool) -> None:
    decode_arrived = asyncio.Event()
    decode_cancelled = asyncio.Event()
    never = asyncio.Event()

    async def prefill(request: web.Request) -> web.Response:
        await asyncio.wait_for(decode_arrived.wait(), DEADLINE)
        return web.json_response({"error": "boom"}, status=500)

    async def decode(request: web.Request) -> web.Response:
        decode_arrived.set()
        try:
            await asyncio.wait_for(never.wait(), DEADLINE)
        except asyncio.CancelledError:
            decode_cancelled.set()
            raise
        return web.json_response({})

    async def main() -> None:
        async with running(stub(prefill), stub(decode)) as (url, cl):
            async with cl.post(url + "/v1/completions", json=completion_body(stream)) as resp:
                assert resp.status == 502
                err = (await resp.json())["error"]
            assert err["leg"] == "prefill" and err["upstream_status"] == 500
            assert err["transfer_id"] == resp.headers["X-Request-Id"]
            await asyncio.wait_for(decode_cancelled.wait(), DEADLINE)
            async with cl.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvpush_router_errors_total{kind="upstream",leg="prefill"} 1' in text
            assert "kvpush_router_in_flight 0" in text

    asyncio.run(main())


def test_prefill_failure_mid_stream_ends_stream_with_error_event() -> None:
    first_chunk_read = asyncio.Event()
    never = asyncio.Event()

    async def prefill(request: web.Request) -> web.Response:
        await asyncio.wait_for(first_chunk_read.wait(), DEADLINE)
        return web.json_response({"error": "boom"}, status=500)

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\n')
        await asyncio.wait_for(never.wait(), DEADLINE)
        return resp

    async def main() -> None:
        events: list[bytes] = []
        async with running(stub(prefill), stub(decode)) as (url, cl):
            async with asyncio.timeout(DEADLINE):
                async with cl.post(url + "/v1/completions", json=completion_body(True)) as resp:
                    assert resp.status == 200
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip())
                            first_chunk_read.set()
        assert events[0] == b'{"i": 0}'
        assert json.loads(events[1])["error"]["leg"] == "prefill"
        assert events[2:] == [b"[DONE]"]  # after the error, as vLLM ends a failed stream

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_decode_that_never_answers_gives_504_within_timeout(stream: bool) -> None:
    never = asyncio.Event()

    async def decode(request: web.Request) -> web.Response:
        await asyncio.wait_for(never.wait(), 4 * DEADLINE)
        return web.json_response({})

    async def main() -> None:
        timeout = 0.5
        async with running(stub(ok_prefill), stub(decode), timeout=timeout) as (url, cl):
            start = time.monotonic()
            async with cl.post(url + "/v1/completions", json=completion_body(stream)) as resp:
                elapsed = time.monotonic() - start
                assert resp.status == 504
                err = (await resp.json())["error"]
        assert err["leg"] == "decode" and err["type"] == "upstream_timeout"
        assert timeout <= elapsed < timeout + 2.0

    asyncio.run(main())


def test_client_hang_up_cancels_both_legs() -> None:
    arrived: set[str] = set()
    both_arrived = asyncio.Event()
    cancelled: set[str] = set()
    both_cancelled = asyncio.Event()
    never = asyncio.Event()

    def make(name: str) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            arrived.add(name)
            if len(arrived) == 2:
                both_arrived.set()
            try:
                await asyncio.wait_for(never.wait(), DEADLINE)
            except asyncio.CancelledError:
                cancelled.add(name)
                if len(cancelled) == 2:
                    both_cancelled.set()
                raise
            return web.json_response({})

        return handler

    async def main() -> None:
        async with running(stub(make("prefill")), stub(make("decode"))) as (url, cl):
            call = asyncio.create_task(cl.post(url + "/v1/completions", json=completion_body()))
            await asyncio.wait_for(both_arrived.wait(), DEADLINE)
            call.cancel()  # the client goes away mid-request
            await asyncio.gather(call, return_exceptions=True)
            await asyncio.wait_for(both_cancelled.wait(), DEADLINE)
            async with cl.get(url + "/metrics") as resp:
                assert "kvpush_router_in_flight 0" in await resp.text()

    asyncio.run(main())


def test_unreachable_prefill_gives_502() -> None:
    never = asyncio.Event()

    async def decode(request: web.Request) -> web.Response:
        # Like a real D, wait for KV that never comes: only P's failure can end this.
        await asyncio.wait_for(never.wait(), DEADLINE)
        return web.json_response({"choices": []})

    async def main() -> None:
        async with running(dead_url(), stub(decode)) as (url, cl):
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 502
                err = (await resp.json())["error"]
        assert err["leg"] == "prefill" and err["kind"] == "connection"

    asyncio.run(main())


def test_health_and_metrics() -> None:
    async def main() -> None:
        async with running(stub(ok_prefill), stub(ok_prefill)) as (url, cl):
            async with cl.get(url + "/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["status"] == "ok"
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200
            async with cl.get(url + "/metrics") as resp:
                assert resp.headers["Content-Type"].startswith("text/plain")
                text = await resp.text()
        assert 'kvpush_router_requests_total{endpoint="completions",stream="false"} 1' in text
        assert "kvpush_router_in_flight 0" in text
        assert 'kvpush_router_request_latency_seconds_count{endpoint="completions"} 1' in text
        assert 'kvpush_router_leg_latency_seconds_count{leg="prefill"} 1' in text

        # The instances' state only to an admin (test_router_boundary: anyone else
        # learns that the router is up).
        admin = {"headers": {"Authorization": "Bearer s3cret"}}
        async with running(stub(ok_prefill), dead_url(), admin_token="s3cret") as (url, cl):
            async with cl.get(url + "/health", **admin) as resp:
                assert resp.status == 503
                detail = await resp.json()
        assert detail["prefill"]["ok"] is True and detail["decode"]["ok"] is False

        p_down = stub(ok_prefill, health=500)
        async with running(p_down, stub(ok_prefill), admin_token="s3cret") as (url, cl):
            async with cl.get(url + "/health", **admin) as resp:
                assert resp.status == 503
                probe = (await resp.json())["prefill"]["instances"][0]["probe"]
                assert probe["status"] == 500

    asyncio.run(main())


def test_body_that_is_not_json_goes_to_the_decoder_alone_as_sent() -> None:
    seen: list[bytes] = []

    async def prefill(request: web.Request) -> web.Response:
        raise AssertionError("P must not see a body that is not a request")

    async def decode(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"error": {"message": "bad json", "code": 400}}, status=400)

    async def main() -> None:
        async with running(stub(prefill), stub(decode)) as (url, cl):
            async with cl.post(url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["message"] == "bad json"
        assert seen == [b"{not json"]

    asyncio.run(main())


def test_leg_bodies_and_side_channel_parsing() -> None:
    body = {"prompt": "x", "max_tokens": 9, "stream": True, "stream_options": {}, "min_tokens": 3}
    p = prefill_body(body, "t", chat=False)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p
    # P computes the prompt and pushes it: nothing that only shapes D's output.
    output_only = {
        "logprobs": 3,
        "logit_bias": {"5": 1.0},
        "stop": ["x"],
        "stop_token_ids": [3],
        "response_format": {"type": "json_object"},
        "n": 2,
        "seed": 7,
        "temperature": 0.5,
    }
    p = prefill_body({**body, **output_only}, "t", chat=False)
    # Cheap for one token, and validated by P as by D: kept. Not the seed: P's token is
    # not the client's, and a seeded request on P's CPU engine can kill it (bodies.py).
    assert {k for k in output_only if k in p} == {
        "n",
        "temperature",
        "logit_bias",
        "stop",
        "stop_token_ids",
    }
    chat = {"messages": [], "tools": [{"type": "function"}], "top_logprobs": 2, "logprobs": True}
    chat.update(response_format={"type": "json_object"}, max_completion_tokens=5, echo=True)
    p = prefill_body(chat, "t", chat=True)
    assert p["tools"] == chat["tools"] and p["response_format"] == chat["response_format"]
    assert p["max_completion_tokens"] == 1 and "logprobs" not in p and "top_logprobs" not in p
    d = decode_body(body, "t", None)
    assert d["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": "t"}
    assert d["stream_options"] == {} and body.get("kv_transfer_params") is None
    assert parse_host_port("10.0.0.1:5600") == ("10.0.0.1", 5600)
    assert parse_host_port("[::1]:7") == ("::1", 7)
    for bad in ("nohost", ":5", "h:0", "h:x"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


REFUSAL = {"error": {"message": "bad field", "type": "BadRequestError", "param": None, "code": 400}}


def waits_until_cancelled(arrived: asyncio.Event, cancelled: asyncio.Event) -> Handler:
    """An upstream that, like a real D or P waiting for its peer, never answers by itself."""

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        arrived.set()
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 4 * DEADLINE)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.json_response({})

    return handler


def refuses(status: int, payload: dict[str, Any] = REFUSAL) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(payload, status=status)

    return handler


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 404])
def test_decode_refusal_is_passed_through_at_once_and_cancels_prefill(
    stream: bool, status: int
) -> None:
    arrived, cancelled = asyncio.Event(), asyncio.Event()

    async def main() -> None:
        prefill = stub(waits_until_cancelled(arrived, cancelled))
        async with running(prefill, stub(refuses(status))) as (url, cl):
            start = time.monotonic()
            async with cl.post(url + "/v1/completions", json=completion_body(stream)) as resp:
                assert resp.status == status
                assert await resp.json() == REFUSAL  # vLLM's own body, not the router's
                assert resp.headers["Content-Type"].startswith("application/json")
            assert time.monotonic() - start < 2.0
            await asyncio.wait_for(cancelled.wait(), DEADLINE)  # P aborts the request
            async with cl.get(url + "/metrics") as resp:
                text = await resp.text()
        assert 'kvpush_router_errors_total{kind="refused",leg="decode"} 1' in text

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_refusal_is_passed_through_and_cancels_decode(stream: bool) -> None:
    arrived, cancelled = asyncio.Event(), asyncio.Event()

    async def main() -> None:
        decode = stub(waits_until_cancelled(arrived, cancelled))
        async with running(stub(refuses(422)), decode) as (url, cl):
            async with cl.post(url + "/v1/completions", json=completion_body(stream)) as resp:
                assert resp.status == 422
                assert await resp.json() == REFUSAL
            await asyncio.wait_for(cancelled.wait(), DEADLINE)

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_when_both_refuse_the_decode_legs_refusal_wins(stream: bool) -> None:
    # D got the client's own body, so its refusal is the one a plain server gives.
    mine = {"error": {"message": "decode's words", "code": 400}}
    p_sent = asyncio.Event()

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        p_sent.set()
        return web.json_response(REFUSAL, status=400)

    async def decode(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.wait_for(p_sent.wait(), DEADLINE)
        return web.json_response(mine, status=400)

    async def main() -> None:
        async with running(stub(prefill), stub(decode)) as (url, cl):
            async with cl.post(url + "/v1/completions", json=completion_body(stream)) as resp:
                assert resp.status == 400
                assert await resp.json() == mine

    asyncio.run(main())


@pytest.mark.parametrize("how", ["eof", "abort"])
def test_stream_cut_by_the_decoder_ends_with_an_error_event(how: str) -> None:
    first_read = asyncio.Event()

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\n')
        if how == "abort":  # the decoder dies: the connection breaks mid-body
            await asyncio.wait_for(first_read.wait(), DEADLINE)
            assert request.transport is not None
            request.transport.abort()
        return resp  # "eof": a clean-looking end, but without [DONE]

    async def main() -> None:
        events: list[bytes] = []
        async with running(stub(ok_prefill), stub(decode)) as (url, cl):
            async with asyncio.timeout(DEADLINE):
                async with cl.post(url + "/v1/completions", json=completion_body(True)) as resp:
                    assert resp.status == 200
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip())
                            first_read.set()
        assert events[0] == b'{"i": 0}'
        err = json.loads(events[1])["error"]
        assert err["leg"] == "decode" and err["type"] == "upstream_error"
        assert events[2:] == [b"[DONE]"]

    asyncio.run(main())


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt_logprobs": 1},
        {"echo": True, "logprobs": 1},
        {"use_beam_search": True, "n": 2},
    ],
    ids=["prompt_logprobs", "echo_logprobs", "beam_search"],
)
def test_requests_p_cannot_help_go_to_the_decoder_alone(extra: dict[str, Any]) -> None:
    seen: list[dict[str, Any]] = []

    async def prefill(request: web.Request) -> web.Response:
        raise AssertionError("P must not get this request")

    async def decode(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"text": "D"}]})

    async def main() -> None:
        body = {**completion_body(), **extra}
        async with running(stub(prefill), stub(decode)) as (url, cl):
            async with cl.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["choices"][0]["text"] == "D"
            async with cl.get(url + "/metrics") as resp:
                text = await resp.text()
        assert seen == [body]  # as sent: no kv_transfer_params, D computes the prompt itself
        assert "kvpush_router_decoder_alone_total" in text

    asyncio.run(main())


def test_chat_echo_asks_for_prompt_logprobs() -> None:
    from kvpush.router.bodies import decoder_alone

    assert decoder_alone({"messages": [], "echo": True}, chat=True) == "prompt_logprobs"
    assert decoder_alone({"messages": [], "echo": True, "top_logprobs": None}, chat=True) is None
    assert decoder_alone({"prompt": "x", "echo": True}, chat=False) is None
    assert decoder_alone({"prompt": "x", "logprobs": 2, "n": 3}, chat=False) is None


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "stream_options": {"include_usage": True}},
        {"prompt": "x", "logprobs": -3},
        {"prompt": "x", "logprobs": "2"},
        {"prompt": "x", "logprobs": 500},
        {"prompt": "x", "min_tokens": 9, "max_tokens": 4},
        {"prompt": "x", "min_tokens": -1},
        {"prompt": "x", "logprob_token_ids": [1]},
        {"prompt": "x", "structured_outputs": {"choice": ["a"], "regex": "b"}},
        {"prompt": "x", "response_format": {"type": "json_schema"}},
        {"messages": [], "top_logprobs": 2},
        {"messages": [], "logprobs": "yes"},
        {"messages": [], "min_tokens": 5, "max_completion_tokens": 2},
        {"prompt": "x", "max_tokens": "six"},  # P gets max_tokens=1: it cannot judge these
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": 4096},  # above the decoder's max_model_len (2048 here)
        {"messages": [], "max_completion_tokens": -1},
        {"prompt": "x", "seed": "5"},  # P gets no seed
        {"prompt": "x", "seed": 2**63},
        {"messages": [], "seed": 1.5},
    ],
)
def test_doubtful_fields_p_does_not_get_send_the_request_to_the_decoder_alone(
    body: dict[str, Any],
) -> None:
    from kvpush.router.bodies import decoder_alone

    # P would accept it (it never sees the field) where D may refuse it.
    assert decoder_alone(body, "messages" in body, max_model_len=2048) == "doubtful_field"


def test_valid_fields_p_does_not_get_keep_the_request_split() -> None:
    from kvpush.router.bodies import decoder_alone

    ok: list[dict[str, Any]] = [
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "x", "logprobs": 5, "min_tokens": 2, "max_tokens": 4},
        {"prompt": "x", "structured_outputs": {"choice": ["a"]}},
        {"prompt": "x", "response_format": {"type": "json_object"}},
        {"messages": [], "logprobs": True, "top_logprobs": 3},
        {"prompt": "x", "max_tokens": 2048, "echo": True},
        {"prompt": "x", "max_tokens": 0, "echo": True},
        {"messages": [], "max_tokens": None, "max_completion_tokens": 9},
        {"prompt": "x", "seed": -(2**63), "temperature": 0.8},
    ]
    for body in ok:
        assert decoder_alone(body, "messages" in body, max_model_len=2048) is None, body


def test_max_tokens_above_the_decoders_context_goes_to_the_decoder_alone() -> None:
    # P gets max_tokens=1 and cannot refuse it; the router learns D's max_model_len from
    # its /v1/models (once) and leaves such a request to D.
    seen: list[dict[str, Any]] = []

    async def prefill(request: web.Request) -> web.Response:
        raise AssertionError("P must not get this request")

    async def decode(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response(REFUSAL, status=400)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    d = stub(decode)
    d.router.add_get("/v1/models", models)

    async def main() -> None:
        async with running(stub(prefill), d) as (url, cl):
            body = {**completion_body(), "max_tokens": 101}
            async with cl.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 400 and await resp.json() == REFUSAL
        assert seen == [body]

    asyncio.run(main())
