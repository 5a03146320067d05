"""The side channel's mutual authentication over real ZMQ sockets, and stale lane files."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from kvpush.core import handshake as hs
from kvpush.core.errors import HandshakeError
from kvpush.core.handshake import AgentInfo, HandshakeReply, SideChannelServer, fetch_agent_info
from kvpush.core.lane import LANE_DIR, CompletionLane, remove_stale_lanes
from kvpush.core.layout import KVLayout, Region
from tests.conftest import free_port

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
    """A client that sends whatever frames it is given and keeps every byte it gets."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.got = b""
        self.last = b""
        self.nonce = b""

    def ask(self, *frames: bytes) -> HandshakeReply:
        self.sock.send_multipart(list(frames))
        assert self.sock.poll(3000), "no answer"
        raw = self.last = self.sock.recv()
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
def test_a_side_channel_thread_that_died_is_noticed(server: Callable[..., Server]) -> None:
    s = server()

    def broken() -> None:
        raise RuntimeError("injected")

    s.srv._stop.set()  # the serving thread exits at its next poll
    s.srv._thread.join(timeout=2)
    assert s.srv.running is False  # cleared even on a clean exit
    s.srv._stop.clear()
    s.srv._serve = broken  # type: ignore[method-assign]
    t = threading.Thread(target=s.srv._run)
    s.srv.running = True
    t.start()
    t.join(timeout=2)
    assert s.srv.running is False  # the worker's _check_alive raises on it


def test_garbage_oversized_and_old_versions_get_a_short_refusal(
    server: Callable[..., Server],
) -> None:
    s = server()
    raw = Raw(s.port)
    v1 = enc.encode({"protocol_version": 1, "engine_id": "old", "nonce": os.urandom(16)})
    cases = [
        ((b"\x00\xffgarbage",), "malformed"),
        ((b"a", b"b"), "malformed"),
        ((b"x" * (64 << 10),), "oversized"),
        ((v1,), "version"),
        ((enc.encode({"protocol_version": hs.PROTOCOL_VERSION, "engine_id": "x"}),), "malformed"),
    ]
    for frames, cause in cases:
        reply = raw.ask(*frames)
        assert reply.info is None and reply.error == hs._SHORT[cause], (cause, reply)
    assert not raw.leaked()
    assert {k: v for k, v in s.srv.refused.items() if v} == {
        "malformed": 3,
        "oversized": 1,
        "version": 1,
    }
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
    port = free_port()
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(f"tcp://127.0.0.1:{port}")

    def serve() -> None:
        for answer in answers:
            if not sock.poll(3000):
                break
            req = msgspec.msgpack.decode(sock.recv(), type=hs.HandshakeRequest)
            sock.send(enc.encode(answer if isinstance(answer, HandshakeReply) else answer(req)))
        sock.close(linger=0)

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
