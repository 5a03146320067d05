"""A TCP relay between the router and D that acts the moment D's stream has its first event.

A test that stops a decoder mid-stream races the decoder: a fast one can finish its
answer before a signal sent from the client's side lands. This relay sees D's first
event itself: it calls ``on_first_event`` (say, to freeze D) before passing the event on,
and with ``hold`` passes nothing more until `cut()` closes that connection; what D sent
in between is lost, as when a host dies. ``rewrite_first`` changes the bytes up to the
end of that first event (without changing their length: the chunk's size stays true).
GETs (health probes) pass untouched.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

HEAD_END = b"\r\n\r\n"


class CutLink:
    def __init__(
        self,
        target_port: int,
        hold: bool = True,
        on_first_event: Callable[[], None] | None = None,
        rewrite_first: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.target = ("127.0.0.1", target_port)
        self.hold = hold
        self.on_first_event = on_first_event
        self.rewrite_first = rewrite_first
        self.passed_first = threading.Event()  # a stream's first event is going through
        self.closed_by_router = threading.Event()  # a POST's connection ended on the router side
        self.posts: list[int] = []  # one entry per POST that went to D (appends are atomic)
        self._cut = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="cut-link").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self._cut.set()

    def close(self) -> None:
        self._cut.set()
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()  # D is down: so is the link
                continue
            posted = threading.Event()  # HTTP/1.1 without pipelining: D's next bytes answer it
            for run in (self._up, self._down):
                pair = (client, upstream) if run == self._up else (upstream, client)
                threading.Thread(target=run, args=(*pair, posted), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, posted: threading.Event) -> None:
        try:
            while data := src.recv(65536):
                if data.startswith(b"POST "):
                    posted.set()  # before D can see the request
                    self.posts.append(1)
                dst.sendall(data)
            if posted.is_set():  # (not a health probe's connection)
                self.closed_by_router.set()
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket, posted: threading.Event) -> None:
        held = b""
        try:
            while data := src.recv(65536):
                if not posted.is_set() or self.passed_first.is_set():
                    dst.sendall(data)
                    continue
                held += data
                end = _first_event_end(held)
                if end is None:
                    continue
                if self.on_first_event is not None:
                    self.on_first_event()
                # Set before sending: the router's 200 (which a test checks this against)
                # can reach the client before this thread runs again.
                self.passed_first.set()
                first, rest = held[:end], held[end:]
                if self.rewrite_first is not None:
                    first = self.rewrite_first(first)
                    assert len(first) == end, "a rewrite must keep the length"
                dst.sendall(first if self.hold else first + rest)
                if self.hold:
                    self._cut.wait()
                    return
        except OSError:
            pass
        finally:
            _close(src, dst)


def _first_event_end(data: bytes) -> int | None:
    """Where the first event of an event-stream answer ends (with its chunk's CRLF)."""
    head, sep, body = data.partition(HEAD_END)
    start = body.find(b"data:")
    if not sep or b"text/event-stream" not in head or start < 0:
        return None
    stop = body.find(b"\n\n", start)
    if stop < 0:
        return None
    stop += 2
    if body[stop : stop + 2] == b"\r\n":
        stop += 2  # the end of the chunk it came in
    return len(head) + len(sep) + stop


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()
