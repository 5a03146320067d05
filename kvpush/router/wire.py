"""A lean HTTP/1.1 client for the router's legs (POSTs to the prefill and decode instances).

aiohttp's client costs 110-160 us of CPU per request and a few layers of Python per
streamed chunk; on one core at 64 streams that was most of the router's time. Here a
request is one write of prebuilt bytes on a kept-alive connection and the response is
parsed by llhttp (httptools) in protocol callbacks. Health probes, scrapes and the
admin calls stay on aiohttp (a few a second).

Connections are kept per upstream (scheme, host, port) and reused when a response was
read to its end; one idle for `_IDLE_S` is closed rather than reused, before the
server's own keep-alive timeout (uvicorn's, vLLM's server: 5 s) could close it under a
request.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import socket
import ssl
from collections.abc import Callable

import httptools
from multidict import CIMultiDict
from yarl import URL

_IDLE_S = 4.0
# Bytes held from one response before reading its socket pauses (a slow client).
_HIGH_WATER = 256 * 1024
# One read's most: an SSE event or a unary answer's head fits many times over.
_READ_SIZE = 64 * 1024


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection, or sent what is not HTTP/1.1, before the end
    of its response."""


class Target:
    """An upstream URL, parsed once: where to connect and the request line to send."""

    __slots__ = ("key", "host", "port", "tls", "head")

    def __init__(self, url: str) -> None:
        u = URL(url)
        if u.scheme not in ("http", "https") or not u.host or u.port is None:
            raise ValueError(f"not an http(s) URL with a host: {url!r}")
        self.host, self.port, self.tls = u.host, u.port, u.scheme == "https"
        self.key = (self.tls, self.host, self.port)
        host = f"[{u.host}]" if ":" in u.host else u.host
        if not u.is_default_port():
            host = f"{host}:{u.port}"
        path = u.raw_path_qs or "/"
        self.head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n".encode("latin-1")


@functools.lru_cache(maxsize=4096)
def target(url: str) -> Target:
    return Target(url)


class Response:
    """One upstream response: status and headers once `Upstreams.post` returns, the body
    by `readany` / `read`. The caller must `release()` (reuse the connection if the
    body was read to its end) or `close()` it."""

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.complete = False
        self._delimited = False  # Content-Length or chunked: its end is not the close
        self.keep_alive = False  # the connection can take another request after this one
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Callable[[bytes], bool] | None = None
        self.head: asyncio.Future[None] = conn.loop.create_future()

    def relay(self, sink: Callable[[bytes], bool] | None) -> None:
        """With a `sink`, the body's pieces go to it from the connection's callback, as
        they arrive (a woken reader costs a future, a loop turn and a task step per
        piece), and `readany` returns only at the end of the body, on an error, or with
        the pieces the sink declined (it returned False; then the sink is dropped).
        None: back to buffering for `readany`."""
        self._sink = sink

    async def readany(self) -> bytes:
        """The body received so far and not yet read; b"" at its end."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._size > _HIGH_WATER:
            self._conn.resume()
        self._size = 0
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with it: its connection is reused if the body was read to its end."""
        if self.complete and not self._chunks:
            self._conn.finished()
        else:
            self._conn.close()

    def close(self) -> None:
        """Done with it: its connection is closed (the upstream sees the hang-up)."""
        self._conn.close()

    # -- fed by the connection ----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self._conn.pause()
        if self._sink is None:
            self._wake()

    def _flush(self) -> None:
        """After a read that brought body pieces but not the end: to the sink, if any."""
        sink, chunks = self._sink, self._chunks
        if sink is None or not chunks or self.complete or self._error is not None:
            return
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if sink(data):
            if self._size > _HIGH_WATER:
                self._conn.resume()
            self._size = 0
        else:
            chunks.append(data)
            self._sink = None
            self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # the caller may be gone already: not "never retrieved"
        elif not self.complete and self._error is None:
            self._error = exc
        self._wake()


class _Conn(asyncio.BufferedProtocol):
    """One connection to an upstream; at most one request on it at a time.

    Buffered: each read lands in the pool's one buffer, which llhttp parses at once (its
    callbacks copy what they keep), where a plain protocol's read allocates a new
    256 KiB buffer and shrinks it, per read (on glibc, at times an mmap, mremap and
    munmap per read)."""

    def __init__(self, pool: Upstreams, key: tuple[bool, str, int]) -> None:
        self.loop = asyncio.get_running_loop()
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.lost = False
        self.paused = False
        self.idle_since = 0.0

    def start(self, data: bytes) -> Response:
        resp = self.resp = Response(self)
        assert self.transport is not None
        self.transport.write(data)
        return resp

    def finished(self) -> None:
        resp_keep_alive = self.resp is not None and self.resp.keep_alive
        self.resp = None
        if self.lost or not resp_keep_alive:
            self.close()
        else:
            self.idle_since = self.loop.time()
            self.pool.idle(self)

    def close(self) -> None:
        self.resp = None
        if self.transport is not None:
            self.transport.close()
        self.lost = True

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.pool.buffer

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.parser.feed_data(self.pool.buffer[:nbytes])
        except httptools.HttpParserError as exc:
            if self.resp is not None:
                self.resp._fail(UpstreamClosed(f"not a valid HTTP/1.1 response: {exc}"))
            self.close()
            return
        if self.resp is not None:
            # Once per read, not per piece: what one read brought goes on in one write.
            self.resp._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        resp = self.resp
        if resp is None or resp.complete:
            return
        if resp.head.done() and not resp._delimited and resp._error is None:
            resp.complete = True  # a body that ends with the connection
            resp._wake()
            return
        why = f": {exc}" if exc else ""
        resp._fail(UpstreamClosed(f"the upstream closed the connection mid-response{why}"))

    # -- httptools callbacks --------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        resp.status = self.parser.get_status_code()
        # Asked here: llhttp answers for the message whose headers it just parsed.
        resp.keep_alive = self.parser.should_keep_alive()
        h = resp.headers
        resp._delimited = "Content-Length" in h or "chunked" in h.get("Transfer-Encoding", "")
        if not resp.head.done():
            resp.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._body(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is not None:
            resp.complete = True
            resp._wake()


class Upstreams:
    """Kept-alive connections to the upstreams, and POSTs over them."""

    def __init__(self) -> None:
        self._idle: dict[tuple[bool, str, int], list[_Conn]] = {}
        self._all: set[_Conn] = set()
        self._tls: ssl.SSLContext | None = None
        # Shared by every connection: the loop reads one at a time, and each read is
        # parsed before the next.
        self.buffer = memoryview(bytearray(_READ_SIZE))

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], content_type: str
    ) -> Response:
        """POST `body` to `url`; the response once its status and headers are in. Raises
        OSError (UpstreamClosed among them) when the upstream cannot be reached or
        closes before its headers; a cancel closes the connection."""
        t = target(url)
        # Header values come from aiohttp's parse of the client's request (no CR or LF
        # gets through it) or from the router itself.
        lines = [t.head]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"Content-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
            content_type.encode("latin-1"), len(body)))  # fmt: skip
        lines.append(body)
        conn = self._take(t.key) or await self._connect(t)
        resp = conn.start(b"".join(lines))
        try:
            await resp.head
        except BaseException:
            resp.close()
            raise
        return resp

    def _take(self, key: tuple[bool, str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = asyncio.get_running_loop().time() - _IDLE_S
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be stale
            if not conn.lost and conn.idle_since > oldest:
                return conn
            conn.close()
        return None

    async def _connect(self, t: Target) -> _Conn:
        loop = asyncio.get_running_loop()
        tls = None
        if t.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        made = await loop.create_connection(lambda: _Conn(self, t.key), t.host, t.port, ssl=tls)
        transport, conn = made
        conn.transport = transport  # uvloop may call connection_made only after this
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._all.add(conn)
        return conn

    def idle(self, conn: _Conn) -> None:
        self._idle.setdefault(conn.key, []).append(conn)

    def forget(self, conn: _Conn) -> None:
        self._all.discard(conn)

    def close(self) -> None:
        """Close every connection (the router is stopping)."""
        for conn in list(self._all):
            conn.close()
        self._all.clear()
        self._idle.clear()

    def __len__(self) -> int:
        return len(self._all)
