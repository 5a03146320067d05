"""The side channel's transport: length-prefixed messages over TCP, and the thread that
serves them.

A message is a 4-byte big-endian length and that many bytes. A connection carries one
request at a time: the server reads no more from it until its answer is out. This
replaced ZMQ, whose size cap holds per frame: one connection sending a multi-part
message that never ends grew the server's memory without bound, and an idle ZMQ
connection stays open for good, so a peer could take all of a process's file
descriptors. Here nothing a peer sends is buffered beyond one request of at most
``max_request`` bytes (a longer length is refused before its bytes are read), at most
``max_conns`` connections are held (a new one closes the one idle the longest) and a
connection that sends nothing for ``idle_s`` is closed.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HEADER = 4
MAX_CONNS = 64
IDLE_S = 10.0
_RECV = 1 << 16
_SEND = 1 << 20


class FrameError(Exception):
    """A message could not be sent or received (the reason in words)."""


class FrameTimeout(FrameError):
    """The deadline passed first."""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEADER, "big") + payload


# ---- the client side: blocking, with a deadline --------------------------------------------


def connect(sockaddr: tuple[object, ...], family: int, deadline: float) -> socket.socket:
    """A TCP connection to ``sockaddr`` (numeric, from getaddrinfo), made by ``deadline``."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(_left(deadline))
        sock.connect(sockaddr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, FrameError) as e:
        sock.close()
        raise _error(e, "connect") from e
    return sock


def send(sock: socket.socket, payload: bytes, deadline: float) -> None:
    try:
        sock.settimeout(_left(deadline))
        sock.sendall(frame(payload))
    except OSError as e:
        raise _error(e, "send") from e


def receive(sock: socket.socket, cap: int, deadline: float) -> bytes:
    """One message of at most ``cap`` bytes."""
    size = int.from_bytes(_exactly(sock, HEADER, deadline), "big")
    if size > cap:
        raise FrameError(f"an answer of {size} bytes (at most {cap})")
    return _exactly(sock, size, deadline)


def _exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    # Read in pieces rather than allocating ``n`` at once: a peer that names a large
    # length and then sends nothing costs only what it sent.
    parts: list[bytes] = []
    got = 0
    try:
        while got < n:
            sock.settimeout(_left(deadline))
            part = sock.recv(min(n - got, _SEND))
            if not part:
                raise FrameError("the peer closed the connection")
            parts.append(part)
            got += len(part)
    except OSError as e:
        raise _error(e, "receive") from e
    return b"".join(parts)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FrameTimeout("out of time")
    return left


def _error(e: BaseException, what: str) -> FrameError:
    if isinstance(e, FrameError):
        return e
    if isinstance(e, TimeoutError):
        return FrameTimeout("out of time")
    return FrameError(f"{what}: {e}")


# ---- the server side: one thread, non-blocking sockets -------------------------------------


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    seen: float  # the last time it sent or took bytes
    inbuf: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the answer still to send
    close_after: bool = False  # close once ``out`` is sent (an oversized request)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` (an address or a name; "*" or "" for every IPv4
    interface) and ``port``; raises OSError."""
    bind = "0.0.0.0" if host in ("*", "") else host.strip("[]")
    infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    # A name with both families binds IPv4, as ZMQ (before) did: peers are given addresses.
    family, _, _, _, addr = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class FrameServer:
    """Serves requests on ``sock`` (from `listen`) on its own thread: ``answer`` maps a
    request to its answer, ``refuse`` a request's length over ``max_request`` to the
    answer sent before the connection closes. Neither may raise."""

    def __init__(
        self,
        sock: socket.socket,
        answer: Callable[[bytes], bytes],
        refuse: Callable[[int], bytes],
        max_request: int,
        name: str,
        max_conns: int = MAX_CONNS,
        idle_s: float = IDLE_S,
    ) -> None:
        self._listener, self._answer, self._refuse = sock, answer, refuse
        self._max_request, self._max_conns, self._idle_s = max_request, max_conns, idle_s
        # Connections closed by the server, by cause (fixed keys: read from any thread).
        self.closed: dict[str, int] = {"idle": 0, "crowded": 0}
        self._conns: dict[socket.socket, _Conn] = {}
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self.running = True  # cleared as the thread exits
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # no thread dies silently: the owner checks `running`
            if not self._stop.is_set():
                log.exception("%s stopped", self._thread.name)
            raise
        finally:
            self.running = False
            for conn in list(self._conns.values()):
                self._drop(conn)
            self._sel.close()
            self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, mask in self._sel.select(timeout=0.1):
                if key.fileobj is self._listener:
                    self._accept()
                    continue
                conn = self._conns.get(key.fileobj)  # type: ignore[call-overload]
                if conn is None:
                    continue
                if mask & selectors.EVENT_WRITE:
                    self._write(conn)
                elif mask & selectors.EVENT_READ:
                    self._read(conn)
            self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(16):  # a few per turn: the others' answers must not wait long
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("side channel cannot accept: %s", e)
                    self._stop.wait(0.05)  # the listener stays readable: do not spin
                    return
                continue  # the asker left before we took it
            if len(self._conns) >= self._max_conns:
                oldest = min(self._conns.values(), key=lambda c: c.seen)
                self.closed["crowded"] += 1
                self._drop(oldest)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns[sock] = _Conn(sock, time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Conn) -> None:
        need = HEADER - len(conn.inbuf)
        if need <= 0:
            need = HEADER + int.from_bytes(conn.inbuf[:HEADER], "big") - len(conn.inbuf)
        try:
            data = conn.sock.recv(min(_RECV, need))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.seen = time.monotonic()
        conn.inbuf += data
        self._consume(conn)

    def _consume(self, conn: _Conn) -> None:
        """Answers the request in ``conn.inbuf`` once it is whole."""
        if len(conn.inbuf) < HEADER:
            return
        size = int.from_bytes(conn.inbuf[:HEADER], "big")
        if size > self._max_request:
            conn.inbuf.clear()
            conn.close_after = True
            self._reply(conn, self._refuse(size))
            return
        if len(conn.inbuf) < HEADER + size:
            return
        request = bytes(conn.inbuf[HEADER : HEADER + size])
        del conn.inbuf[: HEADER + size]
        self._reply(conn, self._answer(request))

    def _reply(self, conn: _Conn, answer: bytes) -> None:
        conn.out = memoryview(frame(answer))
        self._sel.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)  # most answers go out at once

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out[:_SEND])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        conn.seen = time.monotonic()
        conn.out = conn.out[sent:]
        if len(conn.out):
            return
        conn.out = None
        if conn.close_after:
            self._drop(conn)
            return
        self._sel.modify(conn.sock, selectors.EVENT_READ)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if now - c.seen > self._idle_s]:
            self.closed["idle"] += 1
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
