"""Real processes with a shared secret: rogue clients and agents get nothing, honest ones push.

P and D are engine processes with real NIXL agents; a third process serves a worker that
exports (fake) CUDA IPC handle bytes. Rogue clients in this process ask their side
channels with no secret, a wrong one, and by replaying the bytes D sent on a captured
honest exchange; we check every byte they got back. A rogue NIXL agent that holds P's
and D's metadata (as if leaked) but never completed a handshake sends them forged
notifications; both drop them and the honest push is verified byte for byte.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from kvpush.core import wire
from kvpush.core.handshake import AgentInfo, fetch_agent_info
from kvpush_bench.sim.engine import SimSpec
from kvpush_bench.sim.process import EngineProcess
from tests.conftest import free_port, illegal_moves, wait_until
from tests.unit.test_handshake import Raw

pytestmark = pytest.mark.integration

SECRET = b"integration-test-secret-6b1f0c"  # fixed: spawned children import this module


class ExportOnly:
    """A peer-copy hook that exports recognizable bytes and maps nothing."""

    def __init__(self, exported: bytes) -> None:
        self.exported = exported

    def export(self) -> bytes:
        return self.exported

    def prepare(self, peer: str, exported: bytes, dst: Any) -> None:
        return None

    def launch(self, prepared: object, src: Any, after: Any = None) -> bool:
        raise AssertionError("never prepared")

    def finished(self, prepared: object) -> bool:
        return True

    def forget(self, peer: str) -> None:
        pass


def _serve_exporter(conn: Connection, port: int, exported: bytes) -> None:
    from kvpush.core.nixl_transport import NixlTransport
    from kvpush.core.types import WorkerConfig
    from kvpush.core.worker import PushWorker, make_agent_name
    from kvpush_bench.sim.ranks import RankMemory, RankShape

    mem = RankMemory(RankShape(), 2, 16, 4096, 16)
    cfg = WorkerConfig(engine_id="M", port=port, shared_secret=SECRET)
    transport = NixlTransport(make_agent_name("M", 0))
    worker = PushWorker(cfg, transport, mem.layout, peer_copy=ExportOnly(exported))
    conn.send(worker.info.agent_name)
    conn.recv()  # until the test is done
    worker.shutdown()


class Proxy:
    """A TCP relay in front of a side channel that records both directions."""

    def __init__(self, target: int) -> None:
        self.port = free_port()
        self.target = target
        self.up = bytearray()  # client -> server
        self.down = bytearray()
        self._listen = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._listen.settimeout(0.1)
        pairs: dict[socket.socket, tuple[socket.socket, bytearray]] = {}
        while not self._stop.is_set():
            try:
                client, _ = self._listen.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                pairs[client] = (server, self.up)
                pairs[server] = (client, self.down)
            except TimeoutError:
                pass
            ready, _, _ = select.select(list(pairs), [], [], 0.05) if pairs else ([], [], [])
            for s in ready:
                other, log = pairs[s]
                data = s.recv(1 << 16)
                if not data:
                    for x in (s, other):
                        pairs.pop(x, None)
                        x.close()
                    continue
                log += data
                other.sendall(data)
        for s in pairs:
            s.close()
        self._listen.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    illegal = {
        e.spec.engine_id: illegal_moves(e)
        for e in made
        if isinstance(e, EngineProcess) and e.proc.is_alive()
    }
    for thing in reversed(made):
        if isinstance(thing, EngineProcess):
            thing.kill()
        else:
            thing()
    # A child's guard catches the strict raise (tests/conftest.py); its count shows it.
    assert not any(illegal.values()), f"illegal state moves: {illegal}"


def start(cleanup: list[Any], name: str) -> EngineProcess:
    spec = SimSpec(name, free_port(), worker={"shared_secret": SECRET, "heartbeat_interval_s": 0.2})
    proc = EngineProcess(spec)
    cleanup.append(proc)
    proc.wait_ready()
    return proc


def start_exporter(cleanup: list[Any], exported: bytes) -> int:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    proc = ctx.Process(target=_serve_exporter, args=(child, port, exported), daemon=True)
    proc.start()

    def stop() -> None:
        try:
            parent.send("stop")
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)

    cleanup.append(stop)
    assert parent.poll(180), "the exporter did not start"
    parent.recv()
    return port


def fetch(port: int, secret: bytes | None = SECRET) -> AgentInfo:
    return fetch_agent_info("127.0.0.1", port, "test", 10.0, secret=secret)


def secrets_of(info: AgentInfo) -> list[bytes]:
    """What must never reach a rogue: the metadata, the IPC handles, the agent's name."""
    out = [info.nixl_metadata, info.agent_name.encode()]
    return out + ([info.peer_copy] if info.peer_copy else [])


def replay(port: int, stream: bytes, want: bytes, timeout: float = 10.0) -> bytes:
    """Send a captured client byte stream to a side channel; everything it answered (the
    server reads one request at a time, so the stream may go at once)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(stream)
        deadline = time.monotonic() + timeout
        while want not in got and time.monotonic() < deadline:
            ready, _, _ = select.select([s], [], [], 0.05)
            if ready:
                data = s.recv(1 << 16)
                if not data:
                    break
                got += data
    return got


def push(p: EngineProcess, d: EngineProcess, rid: str, p_port: int) -> None:
    p.send("prefill", f"{rid}-p", rid, 4)
    d.send("register", f"{rid}-d", rid, 4, "P", "127.0.0.1", p_port)


def verified(d: EngineProcess, rid: str) -> None:
    ev = d.wait_for(lambda e: e[0] in ("recv", "failed") and e[1] == f"{rid}-d", 30)
    assert ev[0] == "recv" and ev[2]["bad_regions"] == 0, ev


def test_rogue_clients_get_no_metadata_while_honest_peers_push(cleanup: list[Any]) -> None:
    ipc = b"CUDA-IPC-" + os.urandom(32)
    m_port = start_exporter(cleanup, ipc)
    p, d = start(cleanup, "P"), start(cleanup, "D")
    proxy = Proxy(p.spec.port)  # D's handshake with P goes through it: captured
    cleanup.append(proxy.close)
    push(p, d, "h0", proxy.port)
    verified(d, "h0")
    assert len(proxy.down) > len(fetch(p.spec.port).nixl_metadata)  # D was served

    for port in (p.spec.port, m_port):
        real = fetch(port)
        assert real.peer_copy == (ipc if port == m_port else None)
        for secret in (None, b"wrong-" + SECRET):
            rogue = Raw(port)
            reply = rogue.ask(rogue.proof(rogue.hello(), secret))
            rogue.close()
            assert reply.info is None and reply.error, reply
            assert not any(x in rogue.got for x in secrets_of(real))
            assert len(rogue.got) < 200  # a challenge and a short refusal
        # D's side of the honest exchange, replayed byte for byte on a new connection.
        got = replay(port, bytes(proxy.up), b"used or expired challenge")
        assert b"used or expired challenge" in got, got
        assert not any(x in got for x in secrets_of(real)) and len(got) < 400, got

    stats = p.stats()
    assert stats["handshake_refused_no_secret"] == 1 and stats["handshake_refused_bad_mac"] == 1
    assert stats["handshake_refused_replay"] == 1, stats
    push(p, d, "h1", p.spec.port)  # the refusals changed nothing for honest peers
    verified(d, "h1")


def test_forged_notifications_are_dropped(cleanup: list[Any]) -> None:
    from kvpush.core.nixl_transport import NixlTransport

    p, d = start(cleanup, "P"), start(cleanup, "D")
    rogue = NixlTransport("rogue-tp0-00000000")
    cleanup.append(rogue.close)
    p_info, d_info = fetch(p.spec.port), fetch(d.spec.port)  # "leaked" metadata
    rogue.add_peer(p_info.agent_name, p_info.nixl_metadata)
    rogue.add_peer(d_info.agent_name, d_info.nixl_metadata)
    d.send("register", "f0-d", "f0", 4, "P", "127.0.0.1", p.spec.port)
    wait_until(lambda: p.stats()["pending_registrations"] == 1, 30, what="D's registration")
    forged_reg = wire.PushReg(
        request_id="rogue-d",
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=d.spec.port,
        decode_tp_size=1,
        local_block_ids=[[0, 1, 2, 3]],
        remote_engine_id="P",
        remote_host="127.0.0.1",
        remote_port=p.spec.port,
        remote_tp_size=1,
        transfer_id="f1",
    )
    to_p = [
        wire.encode(forged_reg),
        wire.encode(wire.PushCancel(request_id="f0-d", transfer_id="f0")),
        wire.encode(wire.Heartbeat(entries=[wire.HbEntry("f0-d", "f0")])),
    ]
    to_d = [
        wire.encode_completion("f0-d", 1),
        wire.encode(wire.PushFail(request_id="f0-d", reason="forged", transfer_id="f0")),
    ]
    for msg in to_p:
        rogue.send_notif(p_info.agent_name, msg)
    for msg in to_d:
        rogue.send_notif(d_info.agent_name, msg)

    def dropped() -> bool:
        rogue.get_notifs()  # progresses the rogue's sends
        p_dropped = p.stats().get("notif_unauthenticated", 0)
        return p_dropped >= len(to_p) and d.stats().get("notif_unauthenticated", 0) >= len(to_d)

    wait_until(dropped, 30, what="the forged notifications dropped")
    assert p.stats()["pending_registrations"] == 1  # the forged one was not kept
    p.send("prefill", "f0-p", "f0", 4)
    verified(d, "f0")  # neither ended early by the forged completion nor cancelled
    p.send("prefill", "f1-p", "f1", 4)  # the rogue's transfer: nobody registered it
    wait_until(lambda: p.stats()["staged"] == 1, 10, what="f1 staged, unmatched")
    assert p.stats()["writes"] + p.stats().get("copies", 0) == 1
