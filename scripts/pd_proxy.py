"""A minimal OpenAI front for vLLM's own NIXL connectors, for the load benchmark.

vLLM ships no proxy for its push connector, so the load benchmark (scripts/load_bench_gpu.py)
puts this one in front of a prefiller and a decoder:

- ``--mode both`` (``NixlPushConnector``): the prefill leg (``max_tokens`` 1, not streamed,
  ``do_remote_decode``) and the client's own request as the decode leg (with
  ``do_remote_prefill``, P's engine id and side channel, and ``remote_request_id``) are sent
  at the same moment with the same ``X-Request-Id``: the in-tree push scheduler pairs P and
  D by that id.
- ``--mode turn`` (``NixlConnector``, pull): the prefill leg first, then the decode leg
  with the ``kv_transfer_params`` P answered with, as vLLM's example proxy and vllm-router do.

Only ``POST /v1/completions`` is proxied (what ``vllm bench serve --backend vllm`` sends);
``/health`` answers when both servers do, ``/v1/models`` is D's.

    python scripts/pd_proxy.py --port 8000 --prefill http://P --decode http://D \
        --mode both --prefill-engine-id push-prefill --prefill-side-channel 127.0.0.1:5600
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

import aiohttp
from aiohttp import web

# Body keys that only a streamed answer may carry (vLLM refuses them on the prefill leg).
_STREAM_ONLY = ("stream", "stream_options")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--prefill", required=True, help="P's base URL")
    p.add_argument("--decode", required=True, help="D's base URL")
    p.add_argument("--mode", choices=("both", "turn"), required=True)
    p.add_argument("--prefill-engine-id", default="", help="both: P's kv engine_id")
    p.add_argument("--prefill-side-channel", default="", metavar="HOST:PORT", help="both: P's")
    args = p.parse_args(argv)
    if args.mode == "both":
        host, _, port = args.prefill_side_channel.rpartition(":")
        if not (args.prefill_engine_id and host and port.isdigit()):
            p.error("--mode both needs --prefill-engine-id and --prefill-side-channel HOST:PORT")
        args.side_host, args.side_port = host, int(port)
    return args


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: the client's request for one token, not streamed, P to hold the KV."""
    out = {k: v for k, v in body.items() if k not in _STREAM_ONLY}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    out.pop("min_tokens", None)
    return out


def push_params(args: argparse.Namespace, rid: str) -> dict[str, Any]:
    """The decode leg's kv_transfer_params for NixlPushConnector. P's request id is
    ``cmpl-<X-Request-Id>-0-<suffix>``; D cannot know the suffix, P matches without it."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": args.prefill_engine_id,
        "remote_request_id": f"cmpl-{rid}-0",
        "remote_host": args.side_host,
        "remote_port": args.side_port,
        "tp_size": 1,
        "pp_size": 1,
    }


async def _post_json(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    async with session.post(url, json=body, headers=headers) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {str(data)[:300]}")
        return dict(data)


async def _prefill_logged(coro: Any, rid: str) -> None:
    """Both legs at once: P's failure is logged (D's leg then errors or times out)."""
    try:
        await coro
    except Exception as e:  # noqa: BLE001 - one request's failure, never the proxy's
        print(f"prefill leg {rid} failed: {e!r}", file=sys.stderr, flush=True)


async def completions(request: web.Request) -> web.StreamResponse:
    args: argparse.Namespace = request.app["args"]
    session: aiohttp.ClientSession = request.app["session"]
    try:
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the body is not a JSON object")
    except ValueError as e:
        return web.json_response({"error": f"bad request body: {e}"}, status=400)
    rid = uuid.uuid4().hex
    headers = {"X-Request-Id": rid}
    p_url = args.prefill + "/v1/completions"
    leg: asyncio.Task[None] | None = None
    if args.mode == "both":
        params = push_params(args, rid)
        leg = asyncio.create_task(
            _prefill_logged(_post_json(session, p_url, prefill_body(body), headers), rid)
        )
    else:
        try:
            answer = await _post_json(session, p_url, prefill_body(body), headers)
            params = answer["kv_transfer_params"]
        except (aiohttp.ClientError, RuntimeError, KeyError, ValueError) as e:
            return web.json_response({"error": f"prefill leg: {e!r}"}, status=502)
    try:
        async with session.post(
            args.decode + "/v1/completions",
            json={**body, "kv_transfer_params": params},
            headers=headers,
        ) as r:
            resp = web.StreamResponse(status=r.status)
            resp.content_type = r.content_type
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except aiohttp.ClientError as e:
        return web.json_response({"error": f"decode leg: {e!r}"}, status=502)
    finally:
        if leg is not None:
            await leg


async def health(request: web.Request) -> web.Response:
    session: aiohttp.ClientSession = request.app["session"]
    args: argparse.Namespace = request.app["args"]
    for url in (args.prefill, args.decode):
        try:
            async with session.get(url + "/health") as r:
                if r.status != 200:
                    return web.Response(status=503, text=f"{url}: {r.status}")
        except aiohttp.ClientError as e:
            return web.Response(status=503, text=f"{url}: {e!r}")
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    session: aiohttp.ClientSession = request.app["session"]
    async with session.get(request.app["args"].decode + "/v1/models") as r:
        return web.Response(status=r.status, body=await r.read(), content_type="application/json")


def make_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app["args"] = args

    async def session_ctx(app: web.Application) -> Any:
        # No connection limit (aiohttp's default is 100): the benchmark's bursts exceed it.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=timeout
        )
        yield
        await app["session"].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.prefill, args.decode = args.prefill.rstrip("/"), args.decode.rstrip("/")
    web.run_app(make_app(args), host=args.host, port=args.port, access_log=None, backlog=1024)
    return 0


if __name__ == "__main__":
    sys.exit(main())
