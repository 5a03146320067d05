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
