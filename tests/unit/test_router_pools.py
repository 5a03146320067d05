"""The router over pools, over real HTTP on 127.0.0.1, against fake vLLM upstreams.

A fake decoder answers only once a fake prefiller has answered the same transfer (as a
real D waits for P's push), so a pair that lost its prefiller never succeeds by itself.
Waits are events or polls with a deadline, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from kvpush.router import RouterConfig, make_app, tracking
from kvpush.router.pool import Breaker, InstanceSpec, Policy, affinity_key
from tests.unit.test_router import DEADLINE, serve

FAST = {"health_interval": 0.05, "health_timeout": 0.5, "scrape_interval": 0.05}


class Fake:
    """One fake vLLM server: /health, /metrics, both OpenAI endpoints."""

    def __init__(self, name: str, role: str, prefilled: dict[str, asyncio.Event]) -> None:
        self.name, self.role, self.prefilled = name, role, prefilled
        self.hits: list[str] = []  # transfer ids, in arrival order
        self.health = 200
        self.fail_with = 0  # answer POSTs with this status (0: work)
        self.waiting = 0.0  # what /metrics says
        self.hold: asyncio.Event | None = None  # D: answer only once set
        self.cut_stream: asyncio.Event | None = None  # D: one chunk, then break off once set
        self.error_first = False  # D: a 200 stream whose first event is a 500 error
        self.no_push = False  # P: answers, but its push never comes (it dies right after)
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def start(self) -> Fake:
        app = web.Application()
        app.router.add_post("/v1/completions", self._post)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner, self.url = await serve(app, handler_cancellation=True)
        return self

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            f'vllm:num_requests_running{{engine="0"}} 0.0\n'
            f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
            f'vllm:kv_cache_usage_perc{{engine="0"}} 0.0\n'
        )
        return web.Response(text=text)

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tid = body["kv_transfer_params"]["transfer_id"]
        self.hits.append(tid)
        if self.fail_with:
            return web.json_response({"error": self.name}, status=self.fail_with)
        if self.role == "prefill":
            if not self.no_push:
                self.prefilled.setdefault(tid, asyncio.Event()).set()
            return web.json_response({"choices": [{"text": "P"}]})
        await asyncio.wait_for(self.prefilled.setdefault(tid, asyncio.Event()).wait(), DEADLINE)
        if self.hold is not None:
            await asyncio.wait_for(self.hold.wait(), DEADLINE)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": self.name}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.error_first:  # as vLLM writes a failure after its 200
            await resp.write(b'data: {"error": {"code": 500}}\n\ndata: [DONE]\n\n')
            return resp
        await resp.write(f"data: {json.dumps({'by': self.name})}\n\n".encode())
        if self.cut_stream is not None:
            await asyncio.wait_for(self.cut_stream.wait(), DEADLINE)
            assert request.transport is not None
            request.transport.close()  # sends what was written, then breaks off mid-body
            return resp
        await resp.write(b"data: [DONE]\n\n")
        return resp


@asynccontextmanager
async def pools(
    n_prefill: int, n_decode: int, **config: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession, list[Fake], list[Fake]]]:
    prefilled: dict[str, asyncio.Event] = {}
    ps = [await Fake(f"p{i}", "prefill", prefilled).start() for i in range(n_prefill)]
    ds = [await Fake(f"d{i}", "decode", prefilled).start() for i in range(n_decode)]
    specs = [InstanceSpec("prefill", p.url, ("127.0.0.1", 5600 + i)) for i, p in enumerate(ps)]
    specs += [InstanceSpec("decode", d.url) for d in ds]
    # The admin endpoints open to this (loopback) client without a token.
    settings = {**FAST, "admin_loopback_open": True, **config}
    cfg = RouterConfig(instances=tuple(specs), timeout=DEADLINE, **settings)
    router, url = await serve(make_app(cfg), handler_cancellation=True)
    try:
        async with aiohttp.ClientSession() as client:
            yield url, client, ps, ds
    finally:
        await router.cleanup()
        for fake in ps + ds:
            assert fake.runner is not None
            await fake.runner.cleanup()


async def complete(
    cl: aiohttp.ClientSession, url: str, prompt: str = "hello", stream: bool = False
) -> tuple[int, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}
    async with cl.post(url + "/v1/completions", json=body) as resp:
        if stream:
            return resp.status, [ln for ln in (await resp.text()).splitlines() if ln]
        return resp.status, await resp.json()


async def instances(cl: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    async with cl.get(url + "/admin/instances") as resp:
        assert resp.status == 200
        return {i["url"]: i for i in (await resp.json())["instances"]}


async def _true(value: bool) -> bool:
    return value


async def until_out(cl: aiohttp.ClientSession, url: str, member: str, what: str) -> None:
    """Wait until the router's pool has taken ``member`` (an instance's URL) out."""

    async def out() -> bool:
        return not (await instances(cl, url))[member]["healthy"]

    await until(out, what)


async def until(cond: Callable[[], Any], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_flapping_health_takes_an_instance_out_and_brings_it_back() -> None:
    async def main() -> None:
        async with pools(1, 2) as (url, cl, ps, ds):
            ds[0].health = 500

            await until_out(cl, url, ds[0].url, "d0 taken out")
            for _ in range(6):
                status, body = await complete(cl, url)
                assert status == 200 and body["choices"][0]["text"] == "d1"
            assert ds[0].hits == []
            ds[0].health = 200

            async def back() -> bool:
                return bool((await instances(cl, url))[ds[0].url]["available"])

            await until(back, "d0 back")
            for _ in range(6):
                assert (await complete(cl, url))[0] == 200
            assert ds[0].hits, "traffic comes back to a recovered instance"

    asyncio.run(main())


def test_breaker_opens_after_failures_and_half_opens_for_one_probe() -> None:
    b = Breaker(threshold=2, cooldown=0.2)
    b.failure()
    assert b.allows() and b.state() == "closed"
    b.failure()
    assert b.state() == "open" and not b.allows()
    deadline = time.monotonic() + DEADLINE
    while b.state() != "half_open":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert b.allows()
    b.started()  # the one probe request
    assert not b.allows()
    b.failure()  # the probe failed: open again, for a whole cooldown
    assert b.state() == "open"
    b.opened_at = time.monotonic() - 1.0
    b.started()
    b.success()
    assert b.state() == "closed" and b.allows()

    async def main() -> None:
        policy = Policy(breaker_failures=2, breaker_cooldown=30.0, affinity_chars=0)
        async with pools(2, 1, policy=policy) as (url, cl, ps, ds):
            ps[0].fail_with = 500  # healthy by /health, but every leg fails
            for i in range(12):
                status, _ = await complete(cl, url, prompt=f"prompt {i}")
                assert status == 200  # retried on p1 whenever p0 failed
            assert len(ps[0].hits) == 2, "the open breaker keeps p0 out after 2 failures"
            seen = (await instances(cl, url))[ps[0].url]
            assert seen["breaker"] == "open" and seen["healthy"]
            async with cl.get(url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvpush_router_retries_total{leg="prefill"} 2.0' in text
            want = f'breaker_open{{instance="{ps[0].url}",role="prefill"}} 1.0'
            assert want in text

    asyncio.run(main())


def test_retry_on_another_pair_before_the_first_byte_but_never_after() -> None:
    async def main() -> None:
        async with pools(1, 2, policy=Policy(breaker_failures=100)) as (
            url,
            cl,
            ps,
            ds,
        ):
            ds[0].fail_with = 503
            for _ in range(4):
                status, body = await complete(cl, url)
                assert status == 200 and body["choices"][0]["text"] == "d1"
            assert ds[0].hits, "d0 was tried"
            # Stream: d0 sends a first chunk, then breaks: the client has its 200 and the
            # chunk, so the request must not be sent again; it ends with an error event.
            ds[0].fail_with, ds[0].cut_stream = 0, asyncio.Event()
            ds[1].waiting = 50  # d1 busier: the stream goes to d0, d1 stays free for a retry

            async def scraped() -> bool:
                return bool((await instances(cl, url))[ds[1].url]["waiting"] == 50)

            await until(scraped, "d1's queue scraped")
            before = len(ds[1].hits)
            lines = []
            body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True}
            async with cl.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.strip():
                        lines.append(line.decode().strip())
                        ds[0].cut_stream.set()  # the client has its first byte
            assert json.loads(lines[0][6:]) == {"by": "d0"}
            assert json.loads(lines[1][6:])["error"]["leg"] == "decode"
            assert lines[-1] == "data: [DONE]"
            assert len(ds[1].hits) == before, "not sent again after the first byte"
            # Both decoders refuse at the start: the last failure stands, 502.
            ds[0].fail_with = ds[1].fail_with = 500
            status, body = await complete(cl, url)
            assert status == 502 and body["error"]["leg"] == "decode"

    asyncio.run(main())


def test_drain_lets_in_flight_requests_finish_and_sends_new_ones_elsewhere() -> None:
    async def main() -> None:
        async with pools(1, 2) as (url, cl, ps, ds):
            ds[0].hold = asyncio.Event()
            ds[1].hold = asyncio.Event()
            first = [asyncio.create_task(complete(cl, url)) for _ in range(2)]
            await until(lambda: _true(bool(ds[0].hits) and bool(ds[1].hits)), "both busy")
            drain = {"role": "decode", "url": ds[0].url}
            async with cl.post(url + "/admin/drain", json=drain) as resp:
                assert resp.status == 200 and (await resp.json())["draining"] is True
            ds[1].hold.set()
            for _ in range(5):
                status, body = await complete(cl, url)
                assert status == 200 and body["choices"][0]["text"] == "d1"
            assert len(ds[0].hits) == 1
            assert (await instances(cl, url))[ds[0].url]["in_flight"] == 1
            ds[0].hold.set()
            done = await asyncio.gather(*first)
            assert sorted(b["choices"][0]["text"] for _, b in done) == ["d0", "d1"]
            assert (await instances(cl, url))[ds[0].url]["in_flight"] == 0
            # Everything drained: a clear 503, not a hang.
            async with cl.post(url + "/admin/drain", json={**drain, "url": ds[1].url}):
                pass
            status, body = await complete(cl, url)
            assert status == 503 and body["error"]["type"] == "service_unavailable"

    asyncio.run(main())


def test_prefix_affinity_is_stable_and_falls_back_when_its_prefiller_is_down() -> None:
    async def main() -> None:
        async with pools(3, 1) as (url, cl, ps, ds):

            def owner() -> dict[str, int]:
                return {p.name: len(p.hits) for p in ps}

            chosen: dict[str, str] = {}
            for i in range(12):
                prompt = f"shared system prompt number {i} " * 20
                for _ in range(3):
                    before = owner()
                    assert (await complete(cl, url, prompt=prompt + "tail"))[0] == 200
                    grown = [n for n, c in owner().items() if c > before[n]]
                    assert len(grown) == 1
                    assert chosen.setdefault(prompt, grown[0]) == grown[0], "same prefix, same P"
            assert len(set(chosen.values())) >= 2, "different prefixes spread over prefillers"
            # Its prefiller goes down: the prefix moves to another one, and back after.
            victim = next(p for p in ps if p.name == next(iter(chosen.values())))
            prompt = next(k for k, v in chosen.items() if v == victim.name)
            victim.health = 500

            await until_out(cl, url, victim.url, "victim out")
            count = len(victim.hits)
            assert (await complete(cl, url, prompt=prompt + "tail"))[0] == 200
            assert len(victim.hits) == count
            # Removing another prefiller keeps every other prefix where it was.
            victim.health = 200

            async def back() -> bool:
                return bool((await instances(cl, url))[victim.url]["available"])

            await until(back, "victim back")
            other = next(p for p in ps if p is not victim)
            async with cl.delete(
                url + "/admin/instances", json={"role": "prefill", "url": other.url}
            ) as resp:
                assert resp.status == 200
            for prompt, name in chosen.items():
                if name == other.name:
                    continue
                before = owner()
                assert (await complete(cl, url, prompt=prompt + "tail"))[0] == 200
                assert owner()[name] == before[name] + 1

    asyncio.run(main())


def test_load_from_metrics_steers_decoders() -> None:
    async def main() -> None:
        async with pools(1, 2) as (url, cl, ps, ds):
            ds[0].waiting = 12

            async def scraped() -> bool:
                return bool((await instances(cl, url))[ds[0].url]["waiting"] == 12)

            await until(scraped, "d0's queue scraped")
            for _ in range(6):
                status, body = await complete(cl, url)
                assert status == 200 and body["choices"][0]["text"] == "d1"
            assert ds[0].hits == []

    asyncio.run(main())


def test_a_stream_that_begins_with_an_error_is_sent_again_unless_it_is_the_last_try() -> None:
    async def main() -> None:
        async with pools(1, 2) as (url, cl, ps, ds):
            ds[0].error_first = True
            ds[1].waiting = 50  # d0 first

            async def scraped() -> bool:
                return bool((await instances(cl, url))[ds[1].url]["waiting"] == 50)

            await until(scraped, "d1's queue scraped")
            status, lines = await complete(cl, url, stream=True)
            assert status == 200 and json.loads(lines[0][6:]) == {"by": "d1"}
            assert len(ds[0].hits) == 1 and len(ds[1].hits) == 1
            # No other decoder: vLLM's own stream, error event and all, as a plain server.
            async with cl.post(url + "/admin/drain", json={"role": "decode", "url": ds[1].url}):
                pass
            status, lines = await complete(cl, url, stream=True)
            assert status == 200 and lines == ['data: {"error": {"code": 500}}', "data: [DONE]"]

    asyncio.run(main())


def test_a_stream_on_a_prefiller_not_yet_in_the_pool_is_not_sent_again() -> None:
    """P's probes have not let it in (as right after start-up), so the only P is chosen
    anyway; it answers and pushes. It never left the pool, so D's slow answer must not be
    taken for a lost push (the demo once failed 2 of 8 requests so)."""

    async def main() -> None:
        async with pools(1, 1) as (url, cl, ps, ds):
            ps[0].health = 500

            await until_out(cl, url, ps[0].url, "p0 out")
            ds[0].hold = asyncio.Event()
            sent = asyncio.create_task(complete(cl, url, stream=True))
            await until(lambda: _true(len(ds[0].hits) == 1 and len(ps[0].hits) == 1), "legs")
            # Several of the router's lost-P checks pass while D holds its answer.
            await asyncio.sleep(4 * tracking.LOST_CHECK_S)
            ds[0].hold.set()
            status, events = await sent
            assert status == 200 and events[0] == 'data: {"by": "d0"}', events
            assert len(ps[0].hits) == 1 and len(ds[0].hits) == 1  # not sent again

    asyncio.run(main())


def test_a_stream_whose_prefiller_left_the_pool_after_answering_is_sent_again() -> None:
    """P answered, then died before its push: D would wait for the KV until its watchdog.
    Once P's health probes take it out, the router sends the request again on another
    pair (the client has no byte yet), in well under D's wait."""

    async def main() -> None:
        async with pools(2, 1) as (url, cl, ps, ds):
            ps[1].health = 500  # only p0 in the pool at first

            await until_out(cl, url, ps[1].url, "p1 out")
            ps[0].no_push = True
            start = time.monotonic()
            sent = asyncio.create_task(complete(cl, url, stream=True))
            await until(lambda: _true(len(ps[0].hits) == 1), "p0 answered")
            ps[0].health, ps[1].health = 500, 200  # p0 dies, p1 comes back
            status, events = await sent
            took = time.monotonic() - start
            assert status == 200 and events[0] == 'data: {"by": "d0"}', events
            assert len(ps[1].hits) == 1 and len(ds[0].hits) == 2  # sent again via p1
            assert took < DEADLINE / 2, f"{took:.1f}s: waited for D instead of resending"
            async with cl.get(url + "/metrics") as resp:
                assert 'kvpush_router_retries_total{leg="prefill"} 1.0' in await resp.text()

    asyncio.run(main())


def test_a_chat_key_is_the_beginning_of_the_whole_chat_as_json() -> None:
    # Written message by message, only as far as needed: the same key as the whole
    # chat's JSON cut short, so a prompt keeps its prefiller.
    chats: list[Any] = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "x"}],
        [{"role": "user", "content": "h\u00e9 \u2603", "z": [1, 2.5, None, True]}] * 40,
        [{"b": 1, "a": {"d": "x", "c": float("nan")}}, "text", 7],
        {"not": "a list"},
        [],
    ]
    for chat in chats:
        for chars in (1, 2, 10, 256, 10_000):
            whole = json.dumps(chat, sort_keys=True, default=str)[:chars].encode()
            got = affinity_key({"messages": chat}, True, chars)
            assert got == (whole if chat else None)
