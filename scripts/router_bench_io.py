"""The router benchmark's lean HTTP/1.1 ends: fake upstreams and the load generator.

Both are plain asyncio protocols (uvloop when installed) with hand-written HTTP/1.1, so
that the harness itself costs far less per request than the routers it measures: a fake
upstream parses a request's head and Content-Length and answers from precomputed bytes;
the client sends precomputed request bytes and decodes the chunked (or sized) answer,
timing the first event. Keep-alive on every connection, as the routers' pools use it.

Every time stamp is `time.monotonic()` (CLOCK_MONOTONIC: one clock for every process
on the host). The fake decoder's first event carries `{"upstream": {"recv", "first"}}`:
when it had the whole request, and when its first event was written.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

MODEL = "fake-model"
_now = time.monotonic


def install_uvloop() -> str:
    """Use uvloop's event loop when it is installed; the loop's name either way."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _response(status: str, ctype: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Upstream(asyncio.Protocol):
    """One connection to a fake prefiller or decoder. The prefiller answers every
    completion at once (after `prefill_s`) with one JSON body; the decoder answers a
    streamed one with `tokens` events `gap_s` apart (the first at once) and [DONE]."""

    def __init__(self, role: str, tokens: int, gap_s: float, prefill_s: float) -> None:
        self.role, self.tokens, self.gap_s, self.prefill_s = role, tokens, gap_s, prefill_s
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        t_recv = _now()
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            lines = head.split("\r\n")
            method, path = lines[0].split(" ")[:2]
            size = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    size = int(value)
                elif name == "transfer-encoding":
                    self._send(_response("501 Not Implemented", "text/plain", b"no chunked"))
                    return
            if len(self.buf) < end + 4 + size:
                return
            body = self.buf[end + 4 : end + 4 + size]
            self.buf = self.buf[end + 4 + size :]
            self._handle(method, path.split("?")[0], body, t_recv)

    def _send(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _handle(self, method: str, path: str, body: bytes, t_recv: float) -> None:
        if method == "GET" and path == "/health":
            self._send(_HEALTH)
        elif method == "GET" and path == "/v1/models":
            self._send(_MODELS)
        elif method == "GET" and path == "/metrics":
            self._send(_METRICS)
        elif method == "POST" and path.endswith("/render"):
            # vllm-router asks for a rendered prompt first; vLLM 0.32 without
            # --enable-scale-out refuses at once, as here.
            self._send(_RENDER_OFF)
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            streamed = b'"stream":true' in body.replace(b" ", b"")
            if self.role == "prefill" or not streamed:
                if self.prefill_s:
                    self.loop.call_later(self.prefill_s, self._send, _PREFILL)
                else:
                    self._send(_PREFILL)
            else:
                self._stream(t_recv)
        else:
            self._send(_response("404 Not Found", "text/plain", b"not here"))

    def _stream(self, t_recv: float) -> None:
        first = dict(_TOKEN, upstream={"recv": t_recv, "first": _now()})
        self._send(_STREAM_HEAD + _chunk(_event(first)))
        self._next(1)

    def _next(self, sent: int) -> None:
        if sent >= self.tokens:
            self.timer = None
            self._send(_DONE)
            return
        self.timer = self.loop.call_later(self.gap_s, self._tick, sent)

    def _tick(self, sent: int) -> None:
        self._send(_TOKEN_CHUNK)
        self._next(sent + 1)


_TOKEN: dict[str, Any] = {
    "id": "cmpl-fake",
    "object": "text_completion",
    "created": 0,
    "model": MODEL,
    "choices": [{"index": 0, "text": " a", "finish_reason": None, "logprobs": None}],
}
_TOKEN_CHUNK = _chunk(_event(_TOKEN))
_DONE = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_RENDER_OFF = _response(
    "403 Forbidden",
    "application/json",
    b'{"error":{"message":"Scale-out endpoints are disabled.","type":"PermissionDeniedError",'
    b'"code":403}}',
)
_HEALTH = _response("200 OK", "text/plain", b"")
_CARD = {"id": MODEL, "object": "model", "owned_by": "fake", "max_model_len": 4096}
_MODELS = _response(
    "200 OK", "application/json", json.dumps({"object": "list", "data": [_CARD]}).encode()
)
_METRICS = _response(
    "200 OK",
    "text/plain",
    b"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\nvllm:kv_cache_usage_perc 0.0\n",
)
_PREFILL = _response(
    "200 OK",
    "application/json",
    json.dumps(
        {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "remote_engine_id": "fake",
                "remote_block_ids": [0],
            },
        }
    ).encode(),
)


def serve_upstream(role: str, port: int, tokens: int, gap_s: float, prefill_s: float) -> None:
    install_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Upstream(role, tokens, gap_s, prefill_s), "127.0.0.1", port, backlog=1024
        )
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---- the client ------------------------------------------------------------------------------


class Client(asyncio.Protocol):
    """One keep-alive connection sending one request at a time; `ask()` gives a result
    dict: ok, and for a success the client's send / first-event / end times and the
    decoder's `recv` / `first` from the first event."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[dict[str, Any]] | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)
        self._finish({"ok": False, "error": f"connection lost: {exc or 'closed by peer'}"})

    def ask(self, request: bytes) -> asyncio.Future[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        if self.transport is None:
            self._finish({"ok": False, "error": "not connected"})
            return self.waiter
        self.buf = b""
        self.head: tuple[int, bool, int] | None = None  # status, chunked, content-length
        self.body = b""  # the decoded body (events) so far
        self.t_first: float | None = None
        self.upstream: dict[str, float] | None = None
        self.t_send = _now()
        self.transport.write(request)
        return self.waiter

    def _finish(self, result: dict[str, Any]) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(result)

    def data_received(self, data: bytes) -> None:
        t = _now()
        if self.waiter is None or self.waiter.done():
            return  # nothing asked: a stray byte after an answer
        self.buf += data
        if self.head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            status = int(lines[0].split(" ")[1])
            chunked, size = False, -1
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
                elif name == "content-length":
                    size = int(value)
            self.head = (status, chunked, size)
            self.buf = self.buf[end + 4 :]
        status, chunked, size = self.head
        done = self._dechunk() if chunked else len(self.buf) >= size >= 0
        if not chunked:
            self.body, self.buf = self.buf, b""
        if self.t_first is None:
            end = self.body.find(b"\n\n")
            if status == 200 and end >= 0 and self.body.startswith(b"data: "):
                self.t_first = t
                try:
                    self.upstream = json.loads(self.body[6:end]).get("upstream")
                except ValueError:
                    self.upstream = None
        if not done:
            return
        if status != 200:
            self._finish({"ok": False, "error": f"HTTP {status}"})
        elif self.t_first is None or self.upstream is None:
            self._finish({"ok": False, "error": "no first event with the decoder's times"})
        elif not self.body.rstrip().endswith(b"data: [DONE]"):
            self._finish({"ok": False, "error": "the stream ended without [DONE]"})
        else:
            up = self.upstream
            self._finish(
                {"ok": True, "send": self.t_send, "first": self.t_first, "end": t,
                 "d_recv": up["recv"], "d_first": up["first"]}
            )  # fmt: skip
            if size < 0 and not chunked:
                self.transport.close() if self.transport else None

    def _dechunk(self) -> bool:
        """Move whole chunks from buf to body; True at the last (empty) chunk."""
        buf = self.buf
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                break
            n = int(buf[:line_end].split(b";")[0], 16)
            if n == 0:
                if len(buf) < line_end + 4:
                    break
                self.buf = b""
                return True
            if len(buf) < line_end + 2 + n + 2:
                break  # wait for the whole chunk and its CRLF
            self.body += buf[line_end + 2 : line_end + 2 + n]
            buf = buf[line_end + 2 + n + 2 :]
        self.buf = buf
        return False


def request_bytes(url: str, tokens: int, prompt_tokens: int = 0) -> bytes:
    """A streamed completion; with `prompt_tokens`, its prompt is that many token ids (the
    size of a long prompt's body), else a short text."""
    host = url.split("//", 1)[1]
    prompt: Any = [(i * 7919) % 32000 for i in range(prompt_tokens)] or "hello there"
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": tokens,
                       "stream": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


async def run_level(
    url: str,
    streams: int,
    requests: int,
    tokens: int,
    spread_s: float = 0.0,
    pause_s: float = 0.0,
    prompt_tokens: int = 0,
) -> list[dict[str, Any]]:
    """`requests` requests over `streams` closed-loop streams, each on its own keep-alive
    connection (a new one after a failure); every result, failures too. Stream i starts
    `i / streams * spread_s` in and pauses a random `[0, pause_s)` between requests, so
    that streams of equal length do not stay in lockstep (a burst of every stream's
    request at once, every few ms, is no load a router in service sees)."""
    loop = asyncio.get_running_loop()
    host, port = url.split("//", 1)[1].split(":")
    raw = request_bytes(url, tokens, prompt_tokens)
    results: list[dict[str, Any]] = []
    left = requests

    async def connect() -> Client | None:
        try:
            _, proto = await loop.create_connection(Client, host, int(port))
            return proto
        except OSError as e:
            results.append({"ok": False, "error": f"connect: {e}"})
            return None

    async def stream(i: int) -> None:
        nonlocal left
        conn: Client | None = None
        await asyncio.sleep(i * spread_s / streams)
        while left > 0:
            left -= 1  # claimed before any wait, so that exactly `requests` are sent
            if pause_s:
                await asyncio.sleep(random.random() * pause_s)
            if conn is None or conn.transport is None:
                conn = await connect()
                if conn is None:
                    continue
            try:
                result = await asyncio.wait_for(conn.ask(raw), 120)
            except TimeoutError:
                result = {"ok": False, "error": "no complete answer within 120 s"}
                conn.transport.close() if conn.transport else None
            results.append(result)
            if not result["ok"] and conn.transport is not None:
                conn.transport.close()  # an answer gone wrong: start clean
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    await asyncio.gather(*(stream(i) for i in range(streams)))
    return results
