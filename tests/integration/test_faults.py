"""Faults: the FaultTransport itself, abort races, and the fault matrix over real NIXL."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, PeerGoneError, TransportError
from kvpush.core.memory_transport import Fabric, MemoryTransport
from kvpush.core.transport import WriteState
from kvpush.core.worker import make_agent_name
from kvpush_bench.sim import faults_cli
from kvpush_bench.sim.engine import SimEngine, SimSpec
from kvpush_bench.sim.fault_cases import CASES
from kvpush_bench.sim.fault_matrix import Case, Matrix, MatrixOptions
from kvpush_bench.sim.faults import FaultInjector, FaultPlan, FaultTransport, Rule, kind_of
from tests.conftest import free_port, wait_until

REG = wire.encode(
    wire.PushReg(
        request_id="~x~d",
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=1,
        decode_tp_size=1,
        local_block_ids=[[0]],
        remote_engine_id="P",
        remote_host="127.0.0.1",
        remote_port=2,
        remote_tp_size=1,
    )
)
HB = wire.encode(wire.Heartbeat(entries=[]))
CANCEL = wire.encode(wire.PushCancel(request_id="~x~d"))
DONE = wire.encode(wire.Completion("~x~d", 1))


def wrapped(rules: list[Rule]) -> tuple[MemoryTransport, FaultTransport]:
    """A sender and a receiver wrapped with ``rules``, on one fabric."""
    fabric = Fabric()
    a = MemoryTransport(fabric, "a")
    b = FaultTransport(MemoryTransport(fabric, "b"), FaultInjector(FaultPlan(rules)))
    a.add_peer("b", b"b")
    b.add_peer("a", b"a")
    return a, b


def test_kind_of_every_message() -> None:
    assert [kind_of(m) for m in (REG, HB, CANCEL, DONE)] == ["REG", "HB", "CANCEL", "COMPLETION"]
    with pytest.raises(ValueError):
        Rule("write", "dup")
    with pytest.raises(ValueError):
        Rule("recv", "drop", "NOPE")


def test_recv_drop_dup_and_matching() -> None:
    a, b = wrapped([Rule("recv", "drop", "REG", "~x~"), Rule("recv", "dup", "COMPLETION")])
    for msg in (REG, REG, DONE, HB):
        a.send_notif("b", msg)
    got = [m for _, m in b.get_notifs()]
    assert got == [REG, DONE, DONE, HB]  # the drop rule fired once, the dup once
    assert b.injector.fired == {"recv:drop:REG": 1, "recv:dup:COMPLETION": 1}


def test_recv_delay_and_reorder() -> None:
    a, b = wrapped(
        [
            Rule("recv", "delay", "COMPLETION", delay_s=0.2),
            Rule("recv", "reorder", "REG", delay_s=5.0, after_kind="CANCEL"),
        ]
    )
    t0 = time.monotonic()
    a.send_notif("b", DONE)
    a.send_notif("b", REG)
    assert b.get_notifs() == []
    a.send_notif("b", HB)  # not the kind that releases the held PUSH_REG
    assert b.get_notifs() == [("a", HB)]
    a.send_notif("b", CANCEL)
    assert b.get_notifs() == [("a", CANCEL), ("a", REG)]
    got: list[tuple[str, bytes]] = []
    wait_until(lambda: bool(got.extend(b.get_notifs()) or got), 5, what="delayed completion")
    assert got == [("a", DONE)] and time.monotonic() - t0 >= 0.2
    assert b.pending_faults() == 0


def test_send_fail_and_write_faults() -> None:
    a, b = wrapped(
        [
            Rule("send", "fail", "HB"),
            Rule("write", "fail", match="w1"),
            Rule("write", "error", match="w2"),
            Rule("write", "delay", match="w3", delay_s=0.1),
            Rule("write", "reset", match="w4"),
        ]
    )
    with pytest.raises(PeerGoneError):
        b.send_notif("a", HB)
    b.send_notif("a", HB)  # the rule is spent
    assert a.get_notifs() == [("b", HB)]
    src = np.zeros((0, 3), dtype=np.int64)
    with pytest.raises(TransportError):
        b.write("a", src, src, b"w1:1")
    assert b.check(b.write("a", src, src, b"w2:1")) is WriteState.ERROR
    slow = b.write("a", src, src, b"w3:1")
    assert b.check(slow) is WriteState.PENDING
    wait_until(lambda: b.check(slow) is WriteState.DONE, 5, what="delayed WRITE")
    assert a.get_notifs() == [("b", b"w3:1")]  # the notification comes with the late post
    with pytest.raises(PeerGoneError):
        b.write("a", src, src, b"w4:1")
    fetch = b.injector.wrap_fetch(lambda host, port, *rest: "info")
    with pytest.raises(HandshakeError):
        fetch("127.0.0.1", 1)  # armed by the reset
    assert fetch("127.0.0.1", 1) == "info"
    assert b.calls["write"] == 4


def test_handshake_rule_matches_port() -> None:
    inj = FaultInjector(FaultPlan([Rule("handshake", "fail", match=":7")]))
    fetch = inj.wrap_fetch(lambda host, port, *rest: port)
    assert fetch("127.0.0.1", 8) == 8
    with pytest.raises(HandshakeError):
        fetch("127.0.0.1", 7)
    assert fetch("127.0.0.1", 7) == 7


# ---- abort racing the outcome (in memory) -----------------------------------------------


@pytest.fixture
def engines() -> Iterator[tuple[SimEngine, SimEngine]]:
    fabric = Fabric()
    w = {"heartbeat_interval_s": 0.05}
    p = SimEngine(
        SimSpec("P", free_port(), worker=w), MemoryTransport(fabric, make_agent_name("P", 0))
    )
    d = SimEngine(
        SimSpec("D", free_port(), worker=w), MemoryTransport(fabric, make_agent_name("D", 0))
    )
    yield p, d
    p.close()
    d.close()


def step_both(p: SimEngine, d: SimEngine, events: list[Any]) -> None:
    p.step()
    d.step()
    events += d.take_events()


def test_abort_as_the_kv_lands_is_released_once(engines: tuple[SimEngine, SimEngine]) -> None:
    p, d = engines
    events: list[Any] = []
    d.register("d1", "t1", 2, "P", "127.0.0.1", p.spec.port)
    recvs = d.worker.consumer.recvs
    wait_until(
        lambda: "d1" in recvs and recvs["d1"].state.value == "awaiting",
        step=lambda: step_both(p, d, events),
    )
    p.prefill("p1", "t1", 2)
    wait_until(lambda: "d1" not in recvs, step=p.step, what="D's writer counts the completion")
    d.abort("d1")  # the engine has not seen the KV arrive yet
    wait_until(lambda: d.held_blocks() == 0, step=lambda: step_both(p, d, events))
    assert [k for k, r, _ in events if r == "d1"] == ["registered", "released"]
    for _ in range(20):  # no second outcome follows for the cancel sent meanwhile
        step_both(p, d, events)
    assert [k for k, r, _ in events if r == "d1"] == ["registered", "released"]


def test_abort_after_watchdog_expiry_is_released_once(
    engines: tuple[SimEngine, SimEngine],
) -> None:
    p, d = engines
    events: list[Any] = []
    d.register("d1", "t1", 2, "P", "127.0.0.1", p.spec.port)
    d.step()
    d.worker.start_step(d.sched.build_meta(now=time.monotonic() + 1e3))  # watchdog expires
    d.abort("d1")  # before the engine has seen the failure
    assert d.held_blocks() == 2  # the abort keeps the blocks until they come back
    wait_until(lambda: d.held_blocks() == 0, step=lambda: step_both(p, d, events))
    assert [k for k, r, _ in events if r == "d1"] == ["registered", "released"]


# ---- the matrix over real NIXL ----------------------------------------------------------


@pytest.fixture(scope="module")
def matrix() -> Iterator[Matrix]:
    m = Matrix(MatrixOptions())
    yield m
    m.close()


@pytest.mark.integration
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_case(matrix: Matrix, case: Case) -> None:
    try:
        row = matrix.run(case)
    except Exception:
        matrix.replace("P")  # leave a working pair for the next case
        matrix.replace("D")
        raise
    assert row["outcome"] in case.expect.split("|"), row
    assert row["victim"] == (case.victim or "-")
    for side, freed in row["freed_s"].items():
        assert freed is not None and freed <= row["bound_s"], (side, row)
    assert row["writer_errors"] == 0, row
    assert row["survivor_ok"], row
    assert row["ok"], row


@pytest.mark.integration
def test_faults_command_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    faults_cli.add_parser(parser.add_subparsers())
    doc = tmp_path / "reliability.md"
    args = parser.parse_args(["faults", "--cases", "dup_reg", "--json", "--doc", str(doc)])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cases"] == 1 and out["passed"] == 1 and out["rows"][0]["outcome"] == "completed"
    page = doc.read_text()
    assert "| dup_reg | registration |" in page and "1 of 1 cases as expected" in page
    assert json.loads(doc.with_suffix(".json").read_text())["faults"]["result"] == out
