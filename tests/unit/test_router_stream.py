"""The relay of a decode stream once the client has its 200: the stall timeout counts
only the wait for the next chunk, on both relay paths (prefill already answered: the
stream is copied in the handler; prefill still running: in a task watched with it)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvpush.router import legs, tracking
from tests.unit.test_router import DEADLINE, completion_body, ok_prefill, running, stub


def prefill_answering(after: asyncio.Event | None) -> web.Application:
    """A prefiller that answers at once, or only once `after` is set."""

    async def prefill(request: web.Request) -> web.Response:
        if after is not None:
            await asyncio.wait_for(after.wait(), DEADLINE)
        return await ok_prefill(request)

    return stub(prefill)


async def events_of(
    url: str, cl: aiohttp.ClientSession, first: asyncio.Event | None = None
) -> list[bytes]:
    events: list[bytes] = []
    async with asyncio.timeout(2 * DEADLINE):
        async with cl.post(url + "/v1/completions", json=completion_body(True)) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if first is not None:
                        first.set()
    return events


@pytest.mark.parametrize("prefill_done", [True, False], ids=["inline", "watched"])
def test_a_stream_that_stalls_after_its_first_event_ends_with_a_timeout_event(
    prefill_done: bool,
) -> None:
    never = asyncio.Event()
    first_read = asyncio.Event()

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"i": 0}\n\n')
        await asyncio.wait_for(never.wait(), 4 * DEADLINE)
        return resp

    async def main() -> None:
        timeout = 0.5
        # Watched: P answers only once the client has D's first event, so P is still
        # running when the relay starts.
        prefill = prefill_answering(None if prefill_done else first_read)
        async with running(prefill, stub(decode), timeout=timeout) as (url, cl):
            start = time.monotonic()
            events = await events_of(url, cl, first_read)
            elapsed = time.monotonic() - start
        assert events[0] == b'{"i": 0}'
        err = json.loads(events[1])["error"]
        assert err["leg"] == "decode" and err["type"] == "upstream_timeout"
        assert "stalled" in err["message"]
        assert events[2:] == [b"[DONE]"]
        assert timeout <= elapsed < timeout + 2.0

    asyncio.run(main())


@pytest.mark.parametrize("prefill_done", [True, False], ids=["inline", "watched"])
def test_a_stream_longer_than_the_timeout_with_short_gaps_is_relayed_whole(
    prefill_done: bool,
) -> None:
    n, gap, timeout = 8, 0.15, 0.5  # 1.2 s in all, no gap near the timeout
    first_read = asyncio.Event()

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(f'data: {{"i": {i}}}\n\n'.encode())
            await asyncio.sleep(gap)  # the pace under test, not synchronisation
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> None:
        prefill = prefill_answering(None if prefill_done else first_read)
        async with running(prefill, stub(decode), timeout=timeout) as (url, cl):
            events = await events_of(url, cl, first_read)
        assert events == [*(f'{{"i": {i}}}'.encode() for i in range(n)), b"[DONE]"]

    asyncio.run(main())


def test_a_client_slower_than_the_stream_gets_every_event_in_order() -> None:
    # Far more than the loopback sockets buffer: the router's relay must hold back (the
    # client's connection is behind) without losing or reordering a byte.
    n, pad = 400, "x" * 32 * 1024

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await resp.write(f'data: {{"i": {i}, "pad": "{pad}"}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> None:
        got: list[Any] = []
        async with running(stub(ok_prefill), stub(decode)) as (url, cl):
            async with asyncio.timeout(6 * DEADLINE):
                async with cl.post(url + "/v1/completions", json=completion_body(True)) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            event = json.loads(line[6:])
                            assert event["pad"] == pad
                            got.append(event["i"])
                            if len(got) < 100:
                                await asyncio.sleep(0.002)  # the pace under test
                        elif line.startswith(b"data: "):
                            got.append(line[6:].strip())
        assert got == [*range(n), b"[DONE]"]

    asyncio.run(main())


def test_an_interrupt_closed_before_its_prefill_callback_runs_cancels_nothing() -> None:
    # P fails in the loop turn in which D's first chunk ended the wait: the done callback
    # is already scheduled when the wait closes its Interrupt, and must not cancel the
    # handler afterwards.
    async def main() -> None:
        prefill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        interrupt = tracking.Interrupt(prefill, None, 1.0)  # type: ignore[arg-type]
        prefill.set_exception(legs.LegError("prefill", "upstream", "boom", 500))
        interrupt.close()
        for _ in range(3):
            await asyncio.sleep(0)  # loop turns for the scheduled callback to run in
        assert interrupt.reason is None
        prefill.exception()

    asyncio.run(main())


# vLLM refuses some streamed requests after its 200 (an id out of the vocabulary, an empty
# prompt in a list): an error event with the 400, then [DONE].
IN_STREAM_400 = (
    b'data: {"error": {"message": "Token id 5000 is out of vocabulary", "code": 400}}\n\n'
    b"data: [DONE]\n\n"
)


@pytest.mark.parametrize("early", [True, False], ids=["greedy", "sampled"])
def test_a_stream_vllm_refuses_after_its_200_gets_ds_200_and_error_event(early: bool) -> None:
    """A plain server answers 200 and the error event; so must the router, whichever leg
    says it first (a red-team run: 400, P's refusal, in 12-15 of 15 tries). P's leg for
    a greedy request is streamed (its refusal is an error event, `head.check_answer`),
    for a sampled one unary (HTTP 400)."""
    p_answered = asyncio.Event()

    async def prefill(request: web.Request) -> web.StreamResponse:
        await request.read()
        if early:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(IN_STREAM_400)
            await resp.write_eof()
        else:
            resp = web.json_response({"error": {"message": "out of vocabulary"}}, status=400)
        p_answered.set()
        return resp

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.wait_for(p_answered.wait(), DEADLINE)  # P's refusal first, mostly
        await resp.write(IN_STREAM_400)
        return resp

    body = {**completion_body(True), "temperature": 0 if early else 0.8}

    async def main() -> None:
        async with running(stub(prefill), stub(decode)) as (url, cl):
            for _ in range(5):
                p_answered.clear()
                async with cl.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert await resp.read() == IN_STREAM_400
            async with cl.get(url + "/metrics") as resp:
                assert "kvpush_router_errors_total{" not in await resp.text()

    asyncio.run(main())


def test_ps_refusal_yields_to_ds_answer_once_d_answered() -> None:
    """The order the race above mostly takes, made certain: P's refusal is in when D's
    first chunk comes."""

    async def main() -> None:
        async def refuse() -> None:
            raise legs.LegError("prefill", "upstream", "HTTP 400", 400)

        async def fail() -> None:
            raise legs.LegError("prefill", "upstream", "HTTP 503", 503)

        refused, failed = asyncio.ensure_future(refuse()), asyncio.ensure_future(fail())
        await asyncio.wait({refused, failed})
        d_refused = legs.LegError("decode", "upstream", "HTTP 400", 400)
        assert tracking.prefill_first(refused, None) is None  # D's stream goes to the client
        assert tracking.prefill_first(refused, d_refused) is d_refused
        assert tracking.prefill_first(failed, None) is failed.exception()  # no KV will come
        assert tracking.prefill_first(failed, d_refused) is failed.exception()

    asyncio.run(main())
