"""The transfer records' move tables: what they allow, refuse, count and show."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush.core import types
from kvpush.core.consumer import RecvTransfer
from kvpush.core.records import PRequest, PushTransfer
from kvpush.core.types import ENDED, POLL, IllegalTransition, Poll, RecvRegistration, State

DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def p_request(state: State) -> PRequest:
    return PRequest("p1", [[1, 2]], "t1", state=state, stats=Counter())


def p_leg(state: State) -> PushTransfer:
    return PushTransfer("p1", [[1, 2]], "t1", state=state, stats=Counter())


def d_recv(state: State) -> RecvTransfer:
    reg = RecvRegistration("d1", [[3, 4]], "P", "127.0.0.1", 5600, transfer_id="t1")
    return RecvTransfer(reg, state=state, stats=Counter())


RECORDS = [
    pytest.param(p_request, PRequest.MOVES, id="P request"),
    pytest.param(p_leg, PushTransfer.MOVES, id="P leg"),
    pytest.param(d_recv, RecvTransfer.MOVES, id="D"),
]


@pytest.mark.parametrize(("make", "moves"), RECORDS)
def test_every_legal_move_passes(make: Any, moves: types.Moves) -> None:
    n = 0
    for old, allowed in moves.items():
        for new in allowed:
            t = make(old)
            types.transition(t, new, t.name, "test")
            assert t.state is new and t.stats["illegal_transition"] == 0
            n += 1
    assert n == sum(len(v) for v in moves.values()) > 0


@pytest.mark.parametrize(("make", "moves"), RECORDS)
def test_every_illegal_move_raises_and_changes_nothing(make: Any, moves: types.Moves) -> None:
    refused = 0
    for old in State:
        for new in set(State) - moves.get(old, frozenset()):
            t = make(old)
            with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
                types.transition(t, new, t.name)
            assert t.state is old and t.stats["illegal_transition"] == 1
            refused += 1
    assert len(types.ILLEGAL_SEEN) == refused
    types.ILLEGAL_SEEN.clear()  # seen on purpose: the autouse check must not fail the test
    # No way out of an ended state, and none back into a record's first state.
    assert not ENDED & set(moves)
    first = next(iter(moves))
    assert all(first not in to for to in moves.values())
    assert refused > len(State) * len(ENDED)


def test_a_few_illegal_moves_by_name() -> None:
    for t, new in [
        (p_leg(State.WRITING), State.CANCELLED),  # a WRITE in flight ends by its outcome
        (p_leg(State.WRITING), State.EXPIRED),
        (p_leg(State.DONE), State.WRITING),
        (p_leg(State.SETTLING), State.DONE),  # nothing was posted
        (p_leg(State.CANCELLING), State.CANCELLED),  # its WRITE's outcome ends it
        (p_request(State.STAGED), State.DONE),  # a D rank has not registered yet
        (p_request(State.EVICTING), State.DONE),  # evicted: it ends EXPIRED
        (d_recv(State.AWAITING), State.CANCELLED),  # not before every source is quiet
        (d_recv(State.CANCELLED), State.DONE),
        (d_recv(State.REGISTERED), State.CANCELLING),  # nothing was sent to cancel
    ]:
        with pytest.raises(IllegalTransition):
            types.transition(t, new, t.name)
    types.ILLEGAL_SEEN.clear()


def test_in_production_an_illegal_move_is_logged_counted_and_made(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(types, "STRICT", False)
    t = p_leg(State.DONE)
    with caplog.at_level(logging.ERROR, logger="kvpush.transfer"):
        types.transition(t, State.FAILED, t.name, "late failure")
    assert t.state is State.FAILED and t.stats["illegal_transition"] == 1
    assert "illegal move done -> failed (late failure)" in caplog.text
    assert types.ILLEGAL_SEEN == []


def test_the_connector_reports_illegal_moves() -> None:
    from kvpush.vllm.config import ConnectorOptions
    from kvpush.vllm.worker_side import WorkerSide

    side = WorkerSide("e", ConnectorOptions(), 0, 1)
    stats: Counter[str] = Counter(illegal_transition=2)
    side.worker = SimpleNamespace(stats=stats, take_observations=dict)  # type: ignore[assignment]
    assert side.stats_delta()["illegal_transitions"] == 2
    stats["illegal_transition"] += 1
    assert side.stats_delta()["illegal_transitions"] == 1


def test_poll_names_every_state() -> None:
    assert set(POLL) == set(State)
    assert ENDED == {s for s, p in POLL.items() if p in (Poll.SUCCESS, Poll.FAILED)}
    assert p_leg(State.DEFERRED).poll() is Poll.WAITING
    assert p_leg(State.WRITING).poll() is Poll.TRANSFERRING
    assert d_recv(State.CANCELLING).poll() is Poll.TRANSFERRING  # a WRITE may still land
    assert d_recv(State.DONE).poll() is Poll.SUCCESS
    assert d_recv(State.EXPIRED).poll() is Poll.FAILED
    # Only a record's own states: P's never pass through D's and the reverse.
    for moves in (PRequest.MOVES, PushTransfer.MOVES, RecvTransfer.MOVES):
        assert set(POLL[s] for s in moves) <= {Poll.WAITING, Poll.TRANSFERRING}
    assert not set(PRequest.MOVES) & set(RecvTransfer.MOVES)
    assert not set(PushTransfer.MOVES) & set(RecvTransfer.MOVES) - {State.CANCELLING}


def test_the_architecture_doc_shows_exactly_the_tables() -> None:
    text = DOCS.read_text()
    for moves in (PRequest.MOVES, PushTransfer.MOVES, RecvTransfer.MOVES):
        drawn = types.render_moves(moves)
        assert f"```text\n{drawn}\n```" in text, drawn


class StubWorker:
    """Just what ``Consumer`` asks of its worker (and of its peer table, which it plays
    too): every P rank connected and reachable, no lane; what it sends and reports is
    recorded. No thread, no clock."""

    def __init__(self) -> None:
        from kvpush.core.layout import KVLayout, Region
        from kvpush.core.types import WorkerConfig

        self.stats: Counter[str] = Counter()
        # No late-write hold unless a test asks (tests/unit/test_late_writes.py).
        self.config = WorkerConfig(engine_id="D", late_write_hold_s=0.0)
        self.layout = KVLayout([Region("r", 4096, 64, 16)], 16)
        self.peers = self
        self.by_agent: dict[str, Any] = {}  # (P ranks a hold would probe: none)
        self.failed: dict[str, None] = {}  # P ranks whose connection failed
        self.sent: list[tuple[str, Any]] = []
        self.events: list[tuple[str, str]] = []
        self.blocks: dict[str, Any] = {}  # the blocks an event came with (a hold's)
        self.quiet = False  # every P rank silent (a registration then rechecks them)
        self.forgotten: list[str] = []

    def ensure(self, host: str, port: int, then: Any) -> Any:
        return SimpleNamespace(agent=f"P{port}", info=SimpleNamespace(peer_copy=None))

    def silent(self, peer: Any) -> bool:
        return self.quiet

    def forget(self, agent: str, failed: bool = False) -> None:
        self.forgotten.append(agent)

    def check_from(self, peer: Any) -> None:
        pass

    def notify(self, agent: str, msg: Any) -> bool:
        self.sent.append((agent, msg))
        return True

    def emit(self, kind: str, rid: str, reason: str = "", blocks: Any = None) -> None:
        self.events.append((kind, rid))
        self.blocks[rid] = blocks

    def observe(self, name: str, seconds: float) -> None:
        pass


def stepped_d(p_ranks: int = 2, hold_s: float = 0.0) -> tuple[Any, StubWorker, RecvTransfer]:
    """A Consumer with one receive AWAITING the WRITEs of ``p_ranks`` P ranks (P0, P1...);
    ``hold_s``: its late_write_hold_s."""
    from kvpush.core.consumer import Consumer

    w = StubWorker()
    w.config = replace(w.config, late_write_hold_s=hold_s)
    c = Consumer(w)  # type: ignore[arg-type]
    reg = RecvRegistration("d1", [[1, 2]], "P", "h", 0, remote_tp_size=p_ranks)
    c.on_item(("reg", reg, None))
    t = c.recvs["d1"]
    assert t.state is State.AWAITING and t.sources == [f"P{i}" for i in range(p_ranks)]
    return c, w, t


def test_stepped_receive_done_after_every_source() -> None:
    from kvpush.core.wire import Completion

    c, w, t = stepped_d()
    c.on_completion("P0", Completion("d1", 2))
    assert t.poll() is Poll.TRANSFERRING and "d1" in c.recvs
    c.on_completion("P0", Completion("d1", 2))  # a second from the same source: ignored
    assert w.stats["completion_wrong_sender"] == 1
    c.on_completion("P1", Completion("d1", 2))
    assert t.state is State.DONE and w.events == [("recv", "d1")] and not c.recvs


def test_stepped_push_fail_waits_for_the_other_source_then_fails() -> None:
    from kvpush.core.wire import Completion, PushCancel, PushFail

    c, w, t = stepped_d()
    c.on_push_fail("P0", PushFail(request_id="d1", reason="WRITE failed"))
    assert t.state is State.CANCELLING  # P1 may still be writing into the blocks
    # Only P1 is asked to stop: P0's PUSH_FAIL says its part has ended.
    assert {a for a, m in w.sent if isinstance(m, PushCancel)} == {"P1"}
    assert w.events == []
    c.on_completion("P1", Completion("d1", 2))
    assert t.state is State.FAILED and w.events == [("failed", "d1")]


def test_stepped_abort_is_released_once_every_source_confirmed() -> None:
    from kvpush.core.wire import PushFail

    c, w, t = stepped_d()
    c.on_item(("cancel", "d1", False))
    assert t.state is State.CANCELLING and w.events == []
    c.on_push_fail("P0", PushFail(request_id="d1", reason="cancelled"))
    assert t.state is State.CANCELLING
    c.on_push_fail("P1", PushFail(request_id="d1", reason="cancelled"))
    assert t.state is State.CANCELLED and w.events == [("released", "d1")]
    c.on_item(("cancel", "d1", False))  # the engine's second word on it changes nothing
    assert w.stats["cancel_after_end"] == 1 and w.events == [("released", "d1")]


def test_stepped_watchdog_expires_an_awaiting_receive() -> None:
    c, w, t = stepped_d(1)
    c.on_item(("cancel", "d1", True))
    assert t.state is State.EXPIRED and w.events == [("failed", "d1")]
    assert w.stats["recv_expired"] == 1


class StubP:
    """Just what ``Producer`` asks of its worker (and of the peer table and transport the
    WRITE route uses): one D (agent "D0", same layout, on the WRITE route) that is
    connected, or whose handshake the test finishes (``connect``); WRITEs the test ends
    (``end_writes``). No thread, no clock."""

    def __init__(self, connected: bool = True) -> None:
        from kvpush.core.layout import KVLayout, Region
        from kvpush.core.types import WorkerConfig

        self.stats: Counter[str] = Counter()
        self.config = WorkerConfig(engine_id="P")
        self.layout = KVLayout([Region("r", 4096, 64, 16, layers=["l0"])], 16)
        info = SimpleNamespace(layout=self.layout, peer_copy=None)
        self.peer = SimpleNamespace(agent="D0", info=info)
        self.peers = self  # it plays the peer table too (without a peer-copy hook)
        self.peer_copy = None
        self.by_key: dict[tuple[str, int], Any] = {}
        self.by_agent: dict[str, Any] = {}
        self.waiting: list[Any] = []  # handshake callbacks
        self.writes: list[Any] = []
        self.transport = self
        self.sent: list[Any] = []
        self.events: list[tuple[str, str]] = []
        self.forgotten: list[str] = []
        if connected:
            self.connect()

    def connect(self) -> None:
        self.by_key[("h", 7)] = self.by_agent[self.peer.agent] = self.peer

    def forget(self, agent: str, failed: bool = False) -> None:
        self.forgotten.append(agent)
        self.by_agent.pop(agent, None)
        self.by_key = {k: v for k, v in self.by_key.items() if v.agent != agent}

    def get(self, host: str, port: int) -> Any:
        return self.by_key.get((host, port))

    def ensure(self, host: str, port: int, then: Any) -> Any:
        if (host, port) in self.by_key:
            return self.by_key[(host, port)]
        self.waiting.append(then)
        return None

    def load(self, host: str, port: int, fut: Any) -> Any:
        return self.by_key[(host, port)]

    def pairs_to(self, peer: Any) -> Any:
        from kvpush.core.routing import pair_regions

        return pair_regions(self.layout, peer.info.layout)

    def write(self, agent: str, src: Any, dst: Any, notif: bytes) -> Any:
        from kvpush.core.transport import WriteState

        self.writes.append(SimpleNamespace(state=WriteState.PENDING))
        return self.writes[-1]

    def end_writes(self, ok: bool) -> None:
        from kvpush.core.transport import WriteState

        for h in self.writes:
            h.state = WriteState.DONE if ok else WriteState.ERROR

    def check(self, handle: Any) -> Any:
        return handle.state

    def release(self, handle: Any) -> None:
        pass

    def notify(self, agent: str, msg: Any) -> bool:
        self.sent.append(msg)
        return True

    def emit(self, kind: str, rid: str, reason: str = "") -> None:
        self.events.append((kind, rid))

    def observe(self, name: str, seconds: float) -> None:
        pass

    def silent(self, peer: Any) -> bool:
        return False


def push_reg(port: int, transfer_id: str | None = None, rank: int = 0, ranks: int = 1) -> Any:
    """D request d1's registration of blocks 1 and 2, from a decoder at h:``port`` (its
    rank ``rank`` of ``ranks``)."""
    from kvpush.core import wire

    return wire.PushReg(
        request_id=f"d1.{rank}" if rank else "d1",
        decode_engine_id="D",
        decode_host="h",
        decode_port=port,
        decode_tp_size=ranks,
        decode_tp_rank=rank,
        local_block_ids=[[1, 2]],
        remote_engine_id="P",
        remote_host="h",
        remote_port=5600,
        remote_tp_size=1,
        transfer_id=transfer_id,
    )


def stepped_p(connected: bool = True) -> tuple[Any, StubP, PushTransfer]:
    """A Producer whose request p1 met D0's registration d1 (P's blocks first)."""
    from kvpush.core.producer import Producer
    from kvpush.core.types import StagedBlocks

    w = StubP(connected)
    p = Producer(w)  # type: ignore[arg-type]
    p.on_finished(StagedBlocks("p1", [[5, 6]], "t1"))
    p.on_push_reg("D0", push_reg(7, "t1"))
    return p, w, p.by_prid["p1"].legs[0]


def test_stepped_push_writes_then_frees_p_blocks() -> None:
    p, w, leg = stepped_p()
    assert leg.state is State.WRITING and len(w.writes) == 1 and w.events == []
    assert p.sender.check() == 0  # still pending
    w.end_writes(ok=True)
    assert p.sender.check() == 1
    assert leg.state is State.DONE and w.events == [("sent", "p1")]


def test_stepped_push_deferred_behind_the_handshake() -> None:
    p, w, leg = stepped_p(connected=False)
    assert leg.state is State.DEFERRED and leg.poll() is Poll.WAITING and len(w.waiting) == 1
    w.connect()
    w.waiting.pop()(None)  # the handshake's callback: its result goes to P's inbox
    p.on_deferred(p.deferred_push_inbox.get_nowait())
    assert leg.state is State.WRITING and len(w.writes) == 1


def test_stepped_failed_write_fails_the_leg_and_tells_d() -> None:
    from kvpush.core.wire import PushFail

    p, w, leg = stepped_p()
    w.end_writes(ok=False)
    p.sender.check()
    assert leg.state is State.FAILED and w.events == [("sent", "p1")]
    assert [m.reason for m in w.sent if isinstance(m, PushFail)] == ["WRITE failed"]


def test_stepped_cancel_and_lease_end_a_waiting_leg_not_a_writing_one() -> None:
    from kvpush.core.wire import PushCancel

    p, w, leg = stepped_p()
    p.on_cancel("D0", PushCancel(request_id="d1", transfer_id="t1"))
    p.on_evict("p1")
    preq = leg.preq
    assert leg.state is State.CANCELLING and w.events == []  # its outcome ends it
    assert preq.state is State.EVICTING and leg.poll() is Poll.TRANSFERRING
    w.end_writes(ok=True)
    p.sender.check()
    assert leg.state is State.DONE and w.events == [("sent", "p1")]
    assert preq.state is State.EXPIRED and not p.by_prid and not p.sender.busy()
    p, w, leg = stepped_p(connected=False)
    p.on_cancel("D0", PushCancel(request_id="d1", transfer_id="t1"))
    assert leg.state is State.CANCELLED and w.events == [("sent", "p1")]
    p, w, leg = stepped_p(connected=False)
    p.on_evict("p1")
    assert leg.state is State.EXPIRED and w.stats["lease_expired"] == 1
    assert leg.preq.state is State.EXPIRED and w.events == [("sent", "p1")]


def test_stepped_request_is_staged_until_every_d_rank_has_a_leg_then_ends_by_its_legs() -> None:
    from kvpush.core.producer import Producer
    from kvpush.core.types import StagedBlocks

    w = StubP()
    p = Producer(w)  # type: ignore[arg-type]
    p.on_finished(StagedBlocks("p1", [[5, 6]], "t1"))
    preq = p.by_prid["p1"]
    assert preq.state is State.STAGED and p.staged.by_tid("t1") is preq
    p.on_push_reg("D0", push_reg(7, "t1", rank=0, ranks=2))
    assert preq.state is State.STAGED and preq.legs[0].state is State.WRITING
    w.end_writes(ok=True)
    p.sender.check()  # one leg DONE; the other D rank has not registered: blocks kept
    assert preq.legs[0].state is State.DONE and preq.state is State.STAGED and not w.events
    p.on_push_reg("D0", push_reg(7, "t1", rank=1, ranks=2))
    assert preq.state is State.MATCHED and p.staged.by_tid("t1") is None
    assert preq.legs[1].state is State.WRITING and len(w.writes) == 2
    w.end_writes(ok=False)  # the second rank's WRITE fails (the first one's has ended)
    p.sender.check()
    assert preq.legs[1].state is State.FAILED and preq.state is State.FAILED
    assert w.events == [("sent", "p1")] and not p.by_prid and not p.by_dkey


def test_stepped_leg_rechecks_a_restarted_decoder_once_then_fails() -> None:
    from kvpush.core.wire import PushFail

    p, w, leg = stepped_p(connected=False)
    assert leg.state is State.DEFERRED
    w.peer = SimpleNamespace(agent="D1", info=w.peer.info)  # D at h:7 restarted as D1
    w.connect()
    w.waiting.pop()(None)
    p.on_deferred(p.deferred_push_inbox.get_nowait())
    assert leg.state is State.RECHECKING and w.forgotten == ["D1"] and len(w.waiting) == 1
    w.connect()  # the new handshake answers D1 again: not the agent that registered
    w.waiting.pop()(None)
    p.on_deferred(p.deferred_push_inbox.get_nowait())
    assert leg.state is State.FAILED and leg.preq.state is State.FAILED
    assert any(isinstance(m, PushFail) and "not by D1" in m.reason for m in w.sent)


def test_a_hand_over_is_reported_once_sent_and_confirmed_in_either_order() -> None:
    from kvpush.core.records import HandOver

    pushed_first = HandOver("r1")
    assert not pushed_first.on_sent()  # the engine has not finished it: kept back
    assert pushed_first.on_confirmed()
    finished_first = HandOver("r2")
    assert not finished_first.on_confirmed()  # its push still runs
    assert finished_first.on_sent()
