"""Routes (core/routes.py, core/route.py, core/copy_route.py): which one a peer takes, and
the copy route's receiving half ending D's receives, without threads or a clock."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvpush.core import wire
from kvpush.core.copy_route import CopyReceiver, CopyRoute
from kvpush.core.handshake import PROTOCOL_VERSION, AgentInfo
from kvpush.core.lane import LaneView
from kvpush.core.layout import KVLayout, Region
from kvpush.core.memory_transport import Fabric, MemoryTransport
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.route import WriteRoute
from kvpush.core.routes import Routes
from kvpush.core.types import RecvRegistration, State, WorkerConfig
from tests.unit.test_peer_copy import MemmovePeerCopy
from tests.unit.test_transfer_states import StubWorker, push_reg

LAYOUT = KVLayout([Region("r", 4096, 64, 16, layers=["l0"])], 16)


def table(hook: MemmovePeerCopy | None) -> PeerTable:
    """P's peer table; its peers are made by ``meet``, never fetched."""
    fabric = Fabric()
    transport = MemoryTransport(fabric, "P")
    transport.register(LAYOUT)
    cfg = WorkerConfig(engine_id="P")
    return PeerTable(cfg, transport, LAYOUT, None, "P", Counter(), lambda: None, hook, "h")  # type: ignore[arg-type]


def meet(peers: PeerTable, agent: str, port: int, export: bytes | None) -> Peer:
    """The handshake with D ``agent`` (exporting ``export``) completes."""
    MemoryTransport(peers.transport.fabric, agent)  # type: ignore[attr-defined]
    info = AgentInfo(
        protocol_version=PROTOCOL_VERSION,
        engine_id="D",
        tp_rank=0,
        tp_size=1,
        agent_name=agent,
        nixl_metadata=agent.encode(),
        layout=LAYOUT,
        peer_copy=export,
        host_id="h",
    )
    fut: Future[AgentInfo] = Future()
    fut.set_result(info)
    return peers.load("h", port, fut)


def test_a_peer_gets_the_copy_only_when_both_sides_have_the_hook() -> None:
    with_hook = table(MemmovePeerCopy("h1"))
    routes = Routes(with_hook)
    assert isinstance(routes.of(meet(with_hook, "D1", 1, b"h1")), CopyRoute)
    assert isinstance(routes.of(meet(with_hook, "D2", 2, None)), WriteRoute)  # exports nothing
    no_hook = table(None)
    assert isinstance(Routes(no_hook).of(meet(no_hook, "D3", 3, b"h1")), WriteRoute)  # we have none


def test_a_decline_switches_the_peer_for_good_until_it_is_forgotten() -> None:
    peers = table(MemmovePeerCopy("h1"))
    routes = Routes(peers)
    other = meet(peers, "D1", 1, b"h2")  # the hook cannot map it (another host)
    near = meet(peers, "D2", 2, b"h1")
    assert isinstance(routes.of(other), CopyRoute)
    dst = [np.array([1, 2])]
    assert routes.arm(other, push_reg(1), dst) is None
    assert routes.of(other) is routes.write and peers.stats["copy_declined"] == 1
    # for good: the next registration goes straight to the WRITE, asking the hook nothing
    armed = routes.arm(other, push_reg(1), dst)
    assert armed is not None and armed.route is routes.write and armed.dst is None
    assert peers.stats["copy_declined"] == 1
    armed = routes.arm(near, push_reg(2), dst)  # another peer keeps its copy
    assert armed is not None and armed.route is routes.of(near) and armed.agent == "D2"
    assert armed.route is routes.copy
    peers.forget("D1")
    again = meet(peers, "D1", 1, b"h2")  # met again (a restart): chosen afresh
    assert again is not other and isinstance(routes.of(again), CopyRoute)


class LaneStub(StubWorker):
    """``StubWorker`` whose P ranks are on our host and export peer-copy memory."""

    def ensure(self, host: str, port: int, then: Any) -> Any:
        info = SimpleNamespace(peer_copy=b"h", host_id="h")
        return SimpleNamespace(agent=f"P{port}", info=info)


def laned_receive(slots: int) -> tuple[Any, LaneStub, CopyReceiver]:
    from kvpush.core.consumer import Consumer

    w = LaneStub()
    copies = CopyReceiver(slots, "h", w.stats)
    c = Consumer(w, copies)  # type: ignore[arg-type]
    c.on_item(("reg", RecvRegistration("d1", [[1, 2]], "P", "h", 0, remote_tp_size=2), None))
    assert c.recvs["d1"].state is State.AWAITING
    return c, w, copies


def test_lane_words_end_a_receive_as_completions_do() -> None:
    c, w, copies = laned_receive(8)
    try:
        words = {a: m.lane for a, m in w.sent if isinstance(m, wire.PushReg)}
        assert set(words) == {"P0", "P1"} and all(words.values())
        assert c.only_copies() and copies.covered() == 1
        view = LaneView(copies.name)  # type: ignore[arg-type]
        view.set(words["P0"].slot, words["P0"].gen)  # type: ignore[union-attr]
        assert c.poll_copies() == 1 and "d1" in c.recvs  # P1's copy still runs
        view.set(words["P1"].slot, words["P1"].gen)  # type: ignore[union-attr]
        assert c.poll_copies() == 1 and w.events == [("recv", "d1")]
        assert w.stats["lane_done"] == 2 and w.stats["recv_done"] == 1
        assert not copies.waiting and not copies.covered()
        view.close()
    finally:
        copies.close()


def test_a_receive_that_ends_otherwise_gives_its_words_back() -> None:
    c, w, copies = laned_receive(1)  # one word: the second source gets none
    try:
        assert w.stats["lane_full"] == 1 and not c.only_copies() and copies.waiting
        c.on_item(("cancel", "d1", True))  # the watchdog
        assert w.events == [("failed", "d1")]
        assert not copies.waiting and not copies.covered()
    finally:
        copies.close()


class Event:
    """A device event as the WRITE route sees it: ``query()`` says whether it is done."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_an_armed_write_posts_only_checked_ids_behind_a_finished_event() -> None:
    from kvpush.core.records import PendingReg
    from kvpush.core.types import StagedBlocks

    peers = table(None)
    peer = meet(peers, "D1", 1, None)
    fabric = peers.transport.fabric  # type: ignore[attr-defined]
    fabric.agents["D1"].register(LAYOUT)
    fabric.hold_writes = True  # (LAYOUT's addresses are not memory: nothing is copied)
    routes = Routes(peers)
    route = routes.of(peer)
    assert isinstance(route, WriteRoute)
    # D's ids are checked when it registers: one outside D's 16 blocks arms nothing, so
    # the full path meets it at the post and fails the leg with the reason.
    assert routes.arm(peer, push_reg(1), [np.array([1, 16])]) is None
    dst = [np.array([1, 2])]
    armed = routes.arm(peer, push_reg(1), dst)
    assert armed is not None and armed.route is route and armed.agent == "D1"
    pend = PendingReg(push_reg(1), "D1", 0.0, dst, armed)
    # P's blocks still being written: not launched (the leg waits in the sender's settling),
    # nor when asking fails (the full path asks again and fails the leg with the reason).
    assert routes.launch(pend, StagedBlocks("p1", [[7, 8, 9]], None, Event(False))) is None
    broken = Event(True)
    broken.query = lambda: 1 / 0  # type: ignore[method-assign]
    assert routes.launch(pend, StagedBlocks("p1", [[7, 8, 9]], None, broken)) is None
    assert peers.stats["write_early"] == 0
    # Written: posted at once, P's last two blocks (D holds the prompt's first block).
    flight = routes.launch(pend, StagedBlocks("p1", [[7, 8, 9]], None, Event(True)))
    assert flight is not None and peers.stats["write_early"] == 1
    assert flight.agent == "D1" and flight.units == 1 and flight.nbytes == 2 * 64
    (write,) = fabric.writes
    assert write.src.tolist() == [[4096 + 8 * 64, 128, 0]]
    assert write.dst.tolist() == [[4096 + 1 * 64, 128, 0]]
    # P's ids outside its own layout: declined, for the full path to fail it.
    assert routes.launch(pend, StagedBlocks("p2", [[15, 16]])) is None
    assert peers.stats["write_early"] == 1
