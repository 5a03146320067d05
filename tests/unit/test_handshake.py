"""The side channel's mutual authentication over real TCP sockets, its transport's bounds
against hostile connections, and stale lane files."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvpush.core import frames
from kvpush.core import handshake as hs
from kvpush.core.errors import HandshakeError
from kvpush.core.handshake import AgentInfo, HandshakeReply, SideChannelServer, fetch_agent_info
from kvpush.core.lane import LANE_DIR, CompletionLane, remove_stale_lanes
from kvpush.core.layout import KVLayout, Region
from tests.conftest import free_port, wait_until

SECRET = b"unit-test-secret-0123456789"
META = b"NIXL-METADATA-" + os.urandom(48)  # markers to look for in what a client got
IPC = b"CUDA-IPC-HANDLE-" + os.urandom(48)
enc = msgspec.msgpack.Encoder()


def make_info() -> AgentInfo:
    layout = KVLayout([Region("l0", 0x1000, 4096, 256)], 16)
    return AgentInfo(
        protocol_version=hs.PROTOCOL_VERSION,
        engine_id="P",
        tp_rank=0,
        tp_size=1,
        agent_name="P-tp0-abcdef01",
        nixl_metadata=META,
        layout=layout,
        peer_copy=IPC,
    )


class Server:
    def __init__(self, secret: bytes | None) -> None:
        self.port = free_port()
        self.clients: list[str] = []
        self.srv = SideChannelServer(
            "127.0.0.1", self.port, make_info(), secret, self.clients.append
        )

    def fetch(self, secret: bytes | None = SECRET, agent: str = "D-agent") -> AgentInfo:
        return fetch_agent_info("127.0.0.1", self.port, "D", 2.0, secret=secret, agent=agent)


@pytest.fixture
def server() -> Iterator[Callable[..., Server]]:
    made: list[Server] = []

    def make(secret: bytes | None = SECRET) -> Server:
        made.append(Server(secret))
        return made[-1]

    yield make
    for s in made:
        s.srv.close()


class Raw:
    """A client that sends whatever request it is given and keeps every byte it gets."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=3)
        self.got = b""
        self.last = b""
        self.nonce = b""

    def ask(self, request: bytes) -> HandshakeReply:
        deadline = time.monotonic() + 3
        frames.send(self.sock, request, deadline)
        raw = self.last = frames.receive(self.sock, hs.MAX_INFO_BYTES, deadline)
        self.got += raw
        return msgspec.msgpack.decode(raw, type=HandshakeReply)

    def hello(self) -> bytes:
        req = hs.HandshakeRequest(protocol_version=hs.PROTOCOL_VERSION, engine_id="R", step="hello")
        reply = self.ask(enc.encode(req))
        assert len(reply.challenge) == hs.NONCE_BYTES and reply.info is None
        return reply.challenge

    def proof(self, challenge: bytes, secret: bytes | None, agent: str = "R-agent") -> bytes:
        nonce = self.nonce = os.urandom(hs.NONCE_BYTES)
        mac = b""
        if secret is not None:
            mac = hs._mac(hs.Secret(secret), "client", challenge, nonce, agent, "R")
        req = hs.HandshakeRequest(
            protocol_version=hs.PROTOCOL_VERSION,
            engine_id="R",
            step="proof",
            agent=agent,
            nonce=nonce,
            challenge=challenge,
            mac=mac,
        )
        return enc.encode(req)

    def leaked(self) -> bool:
        return META in self.got or IPC in self.got or b"P-tp0-abcdef01" in self.got

    def close(self) -> None:
        self.sock.close()


def test_honest_peers_prove_the_secret_both_ways(server: Callable[..., Server]) -> None:
    s = server()
    info = s.fetch()
    assert info.nixl_metadata == META and info.peer_copy == IPC
    assert s.clients == ["D-agent"]  # the name the worker will hear notifications from
    assert s.srv.served == 1 and not any(s.srv.refused.values())


def test_the_answer_is_enciphered_on_the_wire(server: Callable[..., Server]) -> None:
    s = server()
    raw = Raw(s.port)
    challenge = raw.hello()
    reply = raw.ask(raw.proof(challenge, SECRET))
    assert reply.info is not None and reply.error is None
    assert not raw.leaked()  # served, but not readable without the secret
    plain = hs._cipher(hs.Secret(SECRET), challenge, raw.nonce, reply.info)
    assert msgspec.msgpack.decode(plain, type=AgentInfo).nixl_metadata == META
    raw.close()


@pytest.mark.parametrize(
    ("secret", "cause"), [(None, "no_secret"), (b"wrong-secret", "bad_mac")], ids=["none", "wrong"]
)
def test_client_without_the_secret_gets_no_metadata(
    server: Callable[..., Server], secret: bytes | None, cause: str
) -> None:
    s = server()
    raw = Raw(s.port)
    reply = raw.ask(raw.proof(raw.hello(), secret))
    assert reply.info is None and reply.error and not raw.leaked()
    assert len(raw.got) < 200  # a challenge and a short refusal, nothing else
    with pytest.raises(HandshakeError, match="requires the shared secret|does not match"):
        s.fetch(secret=secret)
    assert s.srv.refused[cause] == 2 and s.clients == []
    assert s.fetch().nixl_metadata == META  # the server goes on serving honest peers
    raw.close()


def test_replayed_and_expired_proofs_are_refused(
    server: Callable[..., Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = server()
    honest = Raw(s.port)
    captured = honest.proof(honest.hello(), SECRET)
    assert honest.ask(captured).info is not None  # the exchange a rogue captured
    rogue = Raw(s.port)
    assert rogue.ask(captured).error == hs._SHORT["replay"]  # the challenge was used
    rogue.hello()  # a fresh challenge does not make the old proof valid
    assert rogue.ask(captured).error == hs._SHORT["replay"]
    monkeypatch.setattr(hs, "CHALLENGE_TTL_S", -1.0)
    assert rogue.ask(rogue.proof(rogue.hello(), SECRET)).error == hs._SHORT["replay"]
    assert not rogue.leaked() and s.srv.refused["replay"] == 3
    assert s.clients == ["R-agent"]  # only the honest exchange authenticated anyone
    honest.close()
    rogue.close()


def test_a_flood_of_hellos_neither_evicts_an_honest_challenge_nor_grows_memory(
    server: Callable[..., Server],
) -> None:
    s = server()
    honest = Raw(s.port)
    challenge = honest.hello()
    flood = Raw(s.port)
    for _ in range(3000):  # more than any bound a table of outstanding challenges could have
        flood.hello()
    forged = bytes(hs.NONCE_BYTES)  # a challenge the server never issued
    assert flood.ask(flood.proof(forged, SECRET)).error == hs._SHORT["replay"]
    assert honest.ask(honest.proof(challenge, SECRET)).info is not None
    assert not s.srv._used.keys() - {challenge}  # only a proven challenge is remembered
    assert s.clients == ["R-agent"]
    honest.close()
    flood.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_side_channel_thread_that_died_is_noticed(
    server: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    s = server()

    def broken(request: bytes) -> bytes:
        raise RuntimeError("injected")

    s.srv._frames._answer = broken  # a bug below the server's own guard
    with pytest.raises(HandshakeError):
        s.fetch()
    wait_until(lambda: not s.srv.running, 2, what="the thread to exit")
    assert "kvpush-side-channel stopped" in caplog.text  # not silently
    with pytest.raises(HandshakeError):  # and nobody is served any more
        s.fetch()


def test_garbage_oversized_and_old_versions_get_a_short_refusal(
    server: Callable[..., Server],
) -> None:
    s = server()
    raw = Raw(s.port)
    v1 = enc.encode({"protocol_version": 1, "engine_id": "old", "nonce": os.urandom(16)})
    cases = [
        (b"\x00\xffgarbage", "malformed"),
        ((v1), "version"),
        (enc.encode({"protocol_version": hs.PROTOCOL_VERSION, "engine_id": "x"}), "malformed"),
    ]
    for request, cause in cases:
        reply = raw.ask(request)
        assert reply.info is None and reply.error == hs._SHORT[cause], (cause, reply)
    assert not raw.leaked()
    assert {k: v for k, v in s.srv.refused.items() if v} == {"malformed": 2, "version": 1}
    raw.ask(v1)  # a version-1 client reads the refusal as one (its reply had these fields)
    old = msgspec.msgpack.decode(raw.last, type=V1Reply)
    assert (
        old.info is None and old.error is not None and f"speaks {hs.PROTOCOL_VERSION}" in old.error
    )
    assert s.fetch().nixl_metadata == META
    raw.close()


class V1Reply(msgspec.Struct, kw_only=True):
    info: bytes | None = None
    mac: bytes = b""
    error: str | None = None


Answer = HandshakeReply | Callable[[hs.HandshakeRequest], HandshakeReply]


def fake_server(answers: list[Answer]) -> tuple[int, threading.Thread]:
    """A side channel that answers each request with the next of ``answers`` (a reply, or
    a function of the request)."""
    listener = frames.listen("127.0.0.1", 0)
    listener.setblocking(True)
    listener.settimeout(3)
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener, listener.accept()[0] as sock:
            for answer in answers:
                deadline = time.monotonic() + 3
                try:
                    raw = frames.receive(sock, hs.MAX_REQUEST_BYTES, deadline)
                except frames.FrameError:
                    break
                req = msgspec.msgpack.decode(raw, type=hs.HandshakeRequest)
                reply = answer if isinstance(answer, HandshakeReply) else answer(req)
                frames.send(sock, enc.encode(reply), deadline)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return port, t


def test_client_accepts_nothing_from_a_server_that_does_not_prove_the_secret() -> None:
    info = enc.encode(make_info())
    for answers, why in [
        ([HandshakeReply(info=info)], "does not prove"),  # serves without a challenge
        (
            [HandshakeReply(challenge=os.urandom(32)), HandshakeReply(info=info, mac=b"x" * 32)],
            "failed to prove",
        ),
        ([HandshakeReply(challenge=b"short")], "malformed handshake challenge"),
    ]:
        port, t = fake_server(answers)
        with pytest.raises(HandshakeError, match=why):
            fetch_agent_info("127.0.0.1", port, "D", 2.0, secret=SECRET)
        t.join(5)


def test_client_refuses_a_replayed_or_reflected_server_answer(
    server: Callable[..., Server],
) -> None:
    s = server()
    raw = Raw(s.port)
    challenge = raw.hello()
    captured = raw.ask(raw.proof(challenge, SECRET))  # an honest answer, to another nonce
    raw.close()
    replayed = [HandshakeReply(challenge=challenge), captured]
    # A server that knows no secret answers the client's own MAC back as its proof.
    reflected = [
        HandshakeReply(challenge=challenge),
        lambda req: HandshakeReply(info=captured.info, mac=req.mac),
    ]
    for answers in (replayed, reflected):
        port, t = fake_server(answers)
        with pytest.raises(HandshakeError, match="failed to prove"):
            fetch_agent_info("127.0.0.1", port, "D", 2.0, secret=SECRET)
        t.join(5)


def test_without_a_secret_anyone_is_served_and_a_warning_says_so(
    server: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "kvpush.core.handshake"):
        s = server(secret=None)
    assert "no shared secret" in caplog.text and "write access" in caplog.text
    assert s.fetch(secret=None).nixl_metadata == META  # as before
    with pytest.raises(HandshakeError, match="does not prove"):
        s.fetch()  # but a peer that has a secret trusts it not


def test_the_secret_is_in_no_log_line(
    server: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    s = server()
    with caplog.at_level(logging.DEBUG):
        s.fetch()
        with pytest.raises(HandshakeError):
            s.fetch(secret=b"wrong-secret")
    assert "bad_mac" in caplog.text and SECRET.decode() not in caplog.text


# ---- lanes left by processes that died ---------------------------------------------------


def _make_lane(conn: Any) -> None:
    lane = CompletionLane(16)
    conn.send(lane.name)
    time.sleep(60)  # killed long before


def test_lane_of_a_killed_decoder_is_removed() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_make_lane, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the child made no lane"
        name = parent.recv()
        path = Path(LANE_DIR) / name
        assert path.exists()
        assert name not in remove_stale_lanes()  # its owner lives: locked, kept
        os.kill(proc.pid or 0, signal.SIGKILL)
        proc.join(10)
        assert name in remove_stale_lanes() and not path.exists()
    finally:
        if proc.is_alive():
            os.kill(proc.pid or 0, signal.SIGKILL)
            proc.join(10)


def test_half_made_lanes_are_removed_once_old(tmp_path: Path) -> None:
    import fcntl

    old, fresh, held = (f"kvpush-lane-{uuid.uuid4().hex}.new" for _ in range(3))
    for name in (old, fresh, held):
        (tmp_path / name).write_bytes(b"\0" * 64)
    for name in (old, held):
        os.utime(tmp_path / name, (time.time() - 3600, time.time() - 3600))
    fd = os.open(tmp_path / held, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live owner
    (tmp_path / "other-file.new").write_bytes(b"")
    try:
        assert remove_stale_lanes(str(tmp_path)) == [old]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh, held, "other-file.new"])


@pytest.mark.parametrize("nameless", [True, False], ids=["o_tmpfile", "renamed"])
def test_a_lane_is_never_seen_unlocked_under_its_name(
    monkeypatch: pytest.MonkeyPatch, nameless: bool
) -> None:
    if nameless:  # made nameless and linked once locked: no temporary name at all
        monkeypatch.setattr(os, "rename", lambda *a: pytest.fail("renamed"))
    else:  # a kernel without O_TMPFILE: made as .new, locked, then renamed
        monkeypatch.delattr(os, "O_TMPFILE")
    lane = CompletionLane(8)
    try:
        assert not list(Path(LANE_DIR).glob(f"{lane.name}.new"))
        assert lane.name not in remove_stale_lanes()  # locked by us
        assert os.stat(lane.path).st_size == 64
    finally:
        lane.close()
    assert not os.path.exists(lane.path)


# ---- the transport's bounds (core/frames.py): what a hostile connection can hold --------------


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (it reads end of stream, or a reset)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_an_oversized_length_is_refused_unread_and_the_connection_closed(
    server: Callable[..., Server],
) -> None:
    s = server()
    with socket.create_connection(("127.0.0.1", s.port), timeout=3) as sock:
        sock.sendall((1 << 30).to_bytes(frames.HEADER, "big"))  # announces 1 GiB, sends none
        reply = msgspec.msgpack.decode(frames.receive(sock, 1 << 20, time.monotonic() + 3))
        assert reply["error"] == hs._SHORT["oversized"] and reply["info"] is None
        wait_until(lambda: _closed(sock), 3, what="the server to close the connection")
    assert s.srv.refused["oversized"] == 1
    assert s.fetch().nixl_metadata == META


def test_a_request_that_never_ends_holds_one_request_of_memory_until_it_is_dropped() -> None:
    """Before, ZMQ buffered an unfinished multi-part message without bound (1 GiB from one
    connection in a red-team run). Now a connection holds at most one request's bytes, and
    one that goes quiet is closed."""
    seen: list[bytes] = []
    srv = frames.FrameServer(
        frames.listen("127.0.0.1", 0), seen.append, lambda n: b"", 4096, "t-frames", idle_s=0.5
    )
    port = srv._listener.getsockname()[1]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
            sock.sendall((4096).to_bytes(frames.HEADER, "big") + b"x" * 4000)  # 96 short
            wait_until(
                lambda: srv._conns and len(next(iter(srv._conns.values())).inbuf) == 4004,
                3,
                what="the server to read what was sent",
            )
            wait_until(lambda: _closed(sock), 3, what="the quiet connection to be closed")
        assert srv.closed["idle"] == 1 and not srv._conns and not seen
    finally:
        srv.close()


def test_a_flood_of_idle_connections_holds_a_bounded_number_and_honest_peers_get_in(
    server: Callable[..., Server],
) -> None:
    """Before, every idle connection stayed open: 20,000 of them took all of P's file
    descriptors and every handshake (so every request through the router) failed."""
    s = server()
    flood = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(3 * frames.MAX_CONNS)]
    try:
        info = s.fetch()  # the newest connection: the flood's oldest made room for it
        assert info.nixl_metadata == META
        assert len(s.srv._frames._conns) <= frames.MAX_CONNS
        assert s.srv.dropped["crowded"] >= 2 * frames.MAX_CONNS
    finally:
        for sock in flood:
            sock.close()


def test_a_client_that_sends_requests_without_reading_answers_gets_one_at_a_time(
    server: Callable[..., Server],
) -> None:
    s = server()
    hello = frames.frame(
        enc.encode(hs.HandshakeRequest(protocol_version=hs.PROTOCOL_VERSION, engine_id="R"))
    )
    with socket.create_connection(("127.0.0.1", s.port), timeout=3) as sock:
        sock.setblocking(False)
        sent = 0
        try:
            for _ in range(
                200_000
            ):  # until the socket buffers are full: the server stopped reading
                sent += sock.send(hello)
        except BlockingIOError:
            pass
        conn = next(iter(s.srv._frames._conns.values()))
        # The server stops reading once an answer cannot go out (the client reads none).
        wait_until(lambda: conn.out is not None, 3, what="an answer to wait for the client")
        assert sent > 100 * len(hello) and len(conn.inbuf) <= len(hello)
    assert s.fetch().nixl_metadata == META


def test_the_client_bounds_what_a_hostile_server_can_make_it_hold() -> None:
    """D handshakes with the P a request names: a P that announces a huge answer, or a
    large one it never sends, fails that handshake alone, within its timeout."""
    for announced, why in [(1 << 31, "an answer of"), (1 << 20, "no handshake answer")]:
        listener = frames.listen("127.0.0.1", 0)
        listener.setblocking(True)
        port = listener.getsockname()[1]

        def serve(listener: socket.socket = listener, announced: int = announced) -> None:
            with listener, listener.accept()[0] as sock:
                frames.receive(sock, hs.MAX_REQUEST_BYTES, time.monotonic() + 3)
                sock.sendall(announced.to_bytes(frames.HEADER, "big") + b"x" * 10)
                try:
                    sock.recv(1)  # until the client leaves
                except OSError:
                    pass

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        start = time.monotonic()
        with pytest.raises(HandshakeError, match=why):
            fetch_agent_info("127.0.0.1", port, "D", 1.0)
        assert time.monotonic() - start < 2.0
        t.join(3)


def test_the_side_channel_binds_the_addresses_zmq_took() -> None:
    """ "*" (every interface) and a name bind IPv4, as the ZMQ transport before did; an
    IPv6 address, bracketed or not, binds IPv6; a host that is no address fails at once."""
    for host, family in [("*", socket.AF_INET), ("localhost", socket.AF_INET)]:
        with frames.listen(host, 0) as sock:
            assert sock.family == family, host
    if socket.has_ipv6:
        for host in ("::1", "[::1]"):
            try:
                sock = frames.listen(host, 0)
            except OSError:
                continue  # no IPv6 loopback on this machine
            with sock:
                assert sock.family == socket.AF_INET6
    with pytest.raises(OSError):
        frames.listen("no-such-host.invalid", 0)
