"""The push state machines end to end over the in-memory transport: two real SimEngines
(each ticking on its engine's thread, its keeper in between), real ZMQ handshakes on loopback,
heartbeats and timers on the wall clock; tests step both engines and poll for outcomes
with deadlines (conftest.wait_until), so they are not deterministic. The stepped,
thread-free tests of the same state machines are in test_transfer_states.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, KVPushError, PeerGoneError
from kvpush.core.handshake import fetch_agent_info
from kvpush.core.memory_transport import Fabric, MemoryTransport
from kvpush.core.transport import WriteState
from kvpush.core.types import StepMeta
from kvpush.core.worker import make_agent_name
from kvpush_bench.sim.engine import SimEngine, SimSpec
from kvpush_bench.sim.ranks import RankShape
from tests.conftest import free_port, wait_until

# late_write_hold_s: D keeps a silently expired receive's blocks this long (late_writes.py)
FAST = {"handshake_timeout_s": 0.5, "heartbeat_interval_s": 0.05, "late_write_hold_s": 0.3}


class Pair:
    def __init__(
        self,
        p_kw: dict[str, Any] | None = None,
        d_kw: dict[str, Any] | None = None,
        p_fetch: Callable[..., Any] = fetch_agent_info,
        p_engine: dict[str, Any] | None = None,
        d_engine: dict[str, Any] | None = None,
        **spec: Any,
    ) -> None:
        """``p_kw`` / ``d_kw``: SimSpec fields of one side (``worker``: WorkerConfig fields);
        ``p_engine`` / ``d_engine``: further SimEngine arguments (``peer_copy``, say);
        ``spec``: SimSpec fields of both."""
        self.fabric = Fabric()
        worker = {**FAST, **spec.pop("worker", {})}
        p_kw, d_kw = dict(p_kw or {}), dict(d_kw or {})
        p_worker = {**worker, **p_kw.pop("worker", {})}
        d_worker = {**worker, **d_kw.pop("worker", {})}
        self.p = SimEngine(
            SimSpec("P", free_port(), worker=p_worker, **spec, **p_kw),
            MemoryTransport(self.fabric, make_agent_name("P", 0)),
            fetch=p_fetch,
            **(p_engine or {}),
        )
        self.d = SimEngine(
            SimSpec("D", free_port(), worker=d_worker, **spec, **d_kw),
            MemoryTransport(self.fabric, make_agent_name("D", 0)),
            **(d_engine or {}),
        )
        self.p_events: list[tuple[str, str, dict[str, Any]]] = []
        self.d_events: list[tuple[str, str, dict[str, Any]]] = []

    def step(self) -> None:
        self.p.step()
        self.d.step()
        self.p_events += self.p.take_events()
        self.d_events += self.d.take_events()

    def register(self, rid: str, tid: str | None, n: int) -> None:
        self.d.register(rid, tid, n, "P", "127.0.0.1", self.p.spec.port)  # type: ignore[arg-type]

    def until(self, cond: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        wait_until(cond, timeout, self.step, what)

    def d_kinds(self, rid: str) -> list[str]:
        return [k for k, r, _ in self.d_events if r == rid and k != "registered"]

    def p_kinds(self, rid: str) -> list[str]:
        return [k for k, r, _ in self.p_events if r == rid and k != "staged"]

    def settle(self) -> None:
        self.until(
            lambda: self.p.held_blocks() == 0 and self.d.held_blocks() == 0, what="no held blocks"
        )

    def close(self) -> None:
        self.p.close()
        self.d.close()


def recv_ok(pair: Pair, rid: str) -> bool:
    return any(k == "recv" and r == rid and i["bad_regions"] == 0 for k, r, i in pair.d_events)


@pytest.mark.parametrize("p_first", [True, False])
@pytest.mark.parametrize("tid", ["tid-1", None])
def test_both_arrival_orders(
    pair_factory: Callable[..., Pair], p_first: bool, tid: str | None
) -> None:
    pair = pair_factory()
    if p_first:
        pair.p.prefill("cmpl-x-0-aaaaaaaa", tid, 6)  # type: ignore[arg-type]
        pair.until(lambda: len(pair.p.worker.producer.staged) == 1)
        pair.register("cmpl-x-0-bbbbbbbb", tid, 6)
    else:
        pair.register("cmpl-x-0-bbbbbbbb", tid, 6)
        pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1)
        pair.p.prefill("cmpl-x-0-aaaaaaaa", tid, 6)  # type: ignore[arg-type]
    pair.until(lambda: recv_ok(pair, "cmpl-x-0-bbbbbbbb"), what="verified receive")
    pair.until(lambda: "sent" in pair.p_kinds("cmpl-x-0-aaaaaaaa"), what="finished_sending on P")
    pair.settle()


def test_d_with_cached_prefix_gets_the_tail(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    pair.p.prefill("p1", "t1", 5)
    blocks = pair.p.p_reqs["p1"]
    pair.register("d1", "t1", 3)
    d_blocks = list(pair.d.d_reqs["d1"][0])
    pair.until(lambda: "recv" in pair.d_kinds("d1") or "failed" in pair.d_kinds("d1"))
    assert "recv" in pair.d_kinds("d1") and len(blocks) == 5
    # D's 3 blocks hold exactly P's last 3, byte for byte, in every region.
    for p_arr, d_arr in zip(pair.p.mem.arrays, pair.d.mem.arrays, strict=True):
        assert (d_arr[d_blocks] == p_arr[blocks[2:]]).all()
        assert (d_arr[d_blocks] != p_arr[blocks[:3]]).any()  # (not the head's bytes)


def test_a_write_armed_at_registration_posts_first_thing(
    pair_factory: Callable[..., Pair],
) -> None:
    """Once P knows D, a registration that comes before P's blocks arms the WRITE, which
    is posted before the producer's bookkeeping when the blocks come (``write_early``)."""
    pair = pair_factory()
    for i, (d_n, p_n) in enumerate([(2, 2), (4, 4), (3, 5)]):  # the first meets D
        pair.register(f"d{i}", f"t{i}", d_n)
        d_blocks = list(pair.d.d_reqs[f"d{i}"][0])
        pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1, what="D's PUSH_REG")
        pair.p.prefill(f"p{i}", f"t{i}", p_n)
        blocks = pair.p.p_reqs[f"p{i}"]
        # (the sim checks a receive's bytes against a whole prompt: the tail is checked below)
        pair.until(lambda i=i: "recv" in pair.d_kinds(f"d{i}"), what=f"receive {i}")
        assert i == 2 or recv_ok(pair, f"d{i}")
        pair.until(lambda i=i: "sent" in pair.p_kinds(f"p{i}"), what="finished_sending on P")
    # The last: D held the prompt's first two blocks, P wrote its last three into D's three.
    for p_arr, d_arr in zip(pair.p.mem.arrays, pair.d.mem.arrays, strict=True):
        assert (d_arr[d_blocks] == p_arr[blocks[2:]]).all()
    st = pair.p.worker.stats
    assert st["writes"] == 3 and st["write_early"] == 2 and st["writes_done"] == 3
    pair.settle()


def test_handshake_failure_on_d_fails_the_receive(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    pair.d.register("d1", "t1", 2, "P", "127.0.0.1", free_port())  # nothing listens there
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="failed receive")
    reason = next(i["reason"] for k, r, i in pair.d_events if k == "failed")
    assert "handshake with P failed" in reason
    pair.settle()


def test_handshake_failure_on_p_frees_without_writing(pair_factory: Callable[..., Pair]) -> None:
    def refuse(*a: Any, **k: Any) -> Any:
        raise HandshakeError("refused by test")

    pair = pair_factory(p_fetch=refuse, watchdog_s=0.5)
    pair.p.prefill("p1", "t1", 4)
    pair.register("d1", "t1", 4)
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="P frees its blocks")
    assert pair.p.worker.stats["writes"] == 0
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="D's watchdog")
    pair.settle()


def test_lease_expiry_frees_p_blocks(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(lease_s=0.2)
    pair.p.prefill("p1", "t1", 4)
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="lease expiry")
    assert pair.p.held_blocks() == 0 and pair.p.worker.stats["writes"] == 0


@pytest.mark.parametrize("p_first", [True, False])
def test_withdrawn_before_registering_frees_p_at_once(
    pair_factory: Callable[..., Pair], p_first: bool
) -> None:
    """D aborted a request before it registered (the client left while it queued): P frees
    the prompt's blocks now, not at lease expiry (30 s here), whichever came first."""
    pair = pair_factory(lease_s=30.0)
    pair.p.prefill("p0", "t0", 1)  # connects D to P
    pair.register("d0", "t0", 1)
    pair.until(lambda: recv_ok(pair, "d0"))
    if p_first:
        pair.p.prefill("p1", "t1", 4)
        pair.until(lambda: len(pair.p.worker.producer.staged) == 1)
    pair.d.withdraw("d1", "t1", "P", "127.0.0.1", pair.p.spec.port)
    if not p_first:
        pair.until(lambda: ("withdrawn", "t1") in pair.p.worker.producer.gone, what="P heard it")
        pair.p.prefill("p1", "t1", 4)
    pair.until(lambda: "sent" in pair.p_kinds("p1"), timeout=5.0, what="P freed p1")
    assert pair.p.worker.stats["withdrawn"] == 1 and pair.p.worker.stats["writes"] == 1
    assert not [k for k in pair.p.worker.producer.gone if k[0] == "withdrawn"]
    pair.settle()


def test_withdrawal_handshakes_with_a_prefiller_not_met_yet(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory(lease_s=30.0)
    pair.p.prefill("p1", "t1", 4)
    pair.d.withdraw("d1", "t1", "P", "127.0.0.1", pair.p.spec.port)
    pair.until(lambda: "sent" in pair.p_kinds("p1"), timeout=5.0, what="P freed p1")
    assert pair.d.worker.stats["withdrawn"] == 1 and pair.d.worker.stats["handshakes"] == 1
    assert pair.p.worker.stats["withdrawn"] == 1 and pair.p.worker.stats["writes"] == 0


def test_withdrawal_to_an_unreachable_prefiller_is_dropped(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    pair.d.withdraw("d1", "t1", "P", "127.0.0.1", free_port())  # nobody listens there
    pair.until(lambda: pair.d.worker.stats["handshakes"] == 1, what="handshake tried")
    pair.until(lambda: not pair.d.worker.peers.handshakes, what="handshake over")
    assert pair.d.worker.stats["withdrawn"] == 0 and pair.d.worker.stats["writer_errors"] == 0


def test_renewed_lease_survives(pair_factory: Callable[..., Pair]) -> None:
    gate = threading.Event()

    def slow(*a: Any, **k: Any) -> Any:
        gate.wait(5)
        return fetch_agent_info(*a, **k)

    pair = pair_factory(p_fetch=slow, lease_s=0.3)
    pair.p.prefill("p1", "t1", 2)
    pair.register("d1", "t1", 2)
    # The push is deferred behind P's slow handshake for longer than the lease;
    # D's heartbeats keep renewing it.
    import time

    end = time.monotonic() + 0.9
    pair.until(lambda: time.monotonic() > end)
    assert "sent" not in pair.p_kinds("p1")
    gate.set()
    pair.until(lambda: recv_ok(pair, "d1"), what="push after the slow handshake")


def test_watchdog_expiry_when_p_goes_silent(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(watchdog_s=0.3)
    pair.fabric.drop = lambda s, t, m: m.startswith(wire.HB_PREFIX)
    pair.register("d1", "t1", 3)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="watchdog")
    assert "watchdog" in next(i["reason"] for k, _, i in pair.d_events if k == "failed")
    # D's cancel reached P: a late prefill does not write into D's freed blocks.
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 0)
    pair.p.prefill("p1", "t1", 3)
    pair.until(lambda: len(pair.p.worker.producer.staged) == 1)
    assert pair.p.worker.stats["writes"] == 0


def test_push_fail_when_registration_ttl_runs_out(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory(worker={"registration_ttl_s": 0.2})
    pair.register("d1", "t1", 3)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), timeout=5, what="PUSH_FAIL")
    reason = next(i["reason"] for k, _, i in pair.d_events if k == "failed")
    assert "prefiller gave up" in reason
    pair.settle()


def test_push_fail_when_d_wants_more_blocks_than_p_holds(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    pair.p.prefill("p1", "t1", 2)
    pair.register("d1", "t1", 5)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="PUSH_FAIL")
    assert pair.p.worker.stats["writes"] == 0
    pair.settle()


def test_out_of_range_registration_never_writes(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    # D is known to P (a first push succeeded), then a registration with a block id
    # past D's advertised range arrives.
    pair.p.prefill("p0", "t0", 1)
    pair.register("d0", "t0", 1)
    pair.until(lambda: recv_ok(pair, "d0"))
    pair.p.prefill("p1", "t1", 2)
    reg = wire.PushReg(
        request_id="d1",
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=pair.d.spec.port,
        decode_tp_size=1,
        local_block_ids=[[1, 10**6]],
        remote_engine_id="P",
        remote_host="127.0.0.1",
        remote_port=pair.p.spec.port,
        remote_tp_size=1,
        transfer_id="t1",
    )
    writes = pair.p.worker.stats["writes"]
    pair.d.worker.transport.send_notif(pair.p.worker.info.agent_name, wire.encode(reg))
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="P drops the push")
    assert pair.p.worker.stats["writes"] == writes
    assert pair.p.worker.stats["reg_invalid"] == 1


def test_cancel_while_deferred_behind_handshake(pair_factory: Callable[..., Pair]) -> None:
    gate = threading.Event()

    def gated(*a: Any, **k: Any) -> Any:
        assert gate.wait(10)
        return fetch_agent_info(*a, **k)

    pair = pair_factory(p_fetch=gated)
    pair.p.prefill("p1", "t1", 3)
    pair.register("d1", "t1", 3)
    pair.until(
        lambda: any(
            leg.state.value == "deferred"
            for preq in pair.p.worker.producer.by_prid.values()
            for leg in preq.legs.values()
        ),
        what="deferred",
    )
    pair.d.abort("d1")
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="P ends the cancelled push")
    assert pair.d.held_blocks() == 3  # fence: D keeps its blocks until P confirms
    gate.set()
    pair.until(lambda: "released" in pair.d_kinds("d1"), what="D released after P's ack")
    assert pair.p.worker.stats["writes"] == 0
    pair.settle()


def test_cancel_during_write_keeps_blocks_until_outcome(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    pair.p.prefill("p0", "t0", 1)
    pair.register("d0", "t0", 1)
    pair.until(lambda: recv_ok(pair, "d0"))
    pair.fabric.hold_writes = True
    pair.p.prefill("p1", "t1", 4)
    pair.register("d1", "t1", 4)
    pair.until(lambda: len(pair.p.worker.producer.sender.writing) == 1, what="WRITE in flight")
    pair.d.abort("d1")
    pair.until(
        lambda: (
            len(pair.d.worker.consumer.recvs) == 1
            and next(iter(pair.d.worker.consumer.recvs.values())).state.value == "cancelling"
        )
    )
    for _ in range(20):
        pair.step()
    assert pair.d.held_blocks() == 4
    pair.fabric.complete_writes()
    pair.until(lambda: "released" in pair.d_kinds("d1"), what="released after the WRITE ended")
    pair.settle()


def test_a_write_on_a_dead_connection_fails_and_the_next_push_reconnects(
    pair_factory: Callable[..., Pair],
) -> None:
    """NIXL reports a broken connection (NIXL_ERR_REMOTE_DISCONNECT) when P checks a WRITE:
    that push fails, and P drops the connection, so the next push handshakes afresh
    instead of failing on the dead one (as every push did over a GPU's TCP link)."""
    pair = pair_factory()
    pair.fabric.hold_writes = True
    transport = pair.p.worker.peers.transport
    real_check = transport.check
    died: list[object] = []

    def check(handle: object) -> WriteState:
        if not died:
            died.append(handle)
            raise PeerGoneError("check write: NIXL_ERR_REMOTE_DISCONNECT")
        return real_check(handle)

    transport.check = check  # type: ignore[method-assign]
    pair.p.prefill("p1", "t1", 4)
    pair.register("d1", "t1", 4)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="the receive failed")
    d_agent = pair.d.worker.peers.transport.agent_name
    assert died and d_agent not in pair.p.worker.peers.by_agent  # forgotten
    pair.fabric.complete_writes()  # (the dead WRITE's handle ends)
    pair.fabric.hold_writes = False
    pair.p.prefill("p2", "t2", 4)
    pair.register("d2", "t2", 4)
    pair.until(lambda: recv_ok(pair, "d2"), what="the next push, over a new connection")
    assert d_agent in pair.p.worker.peers.by_agent
    pair.settle()


def test_a_post_on_a_dead_connection_tells_d_over_a_fresh_one(
    pair_factory: Callable[..., Pair],
) -> None:
    """NIXL refuses the post itself (the connection broke while idle): P forgets D, and
    its PUSH_FAIL goes over a fresh handshake, so D fails the request at once instead of
    at its watchdog (30 s here, past the wait below)."""
    pair = pair_factory()
    transport = pair.p.worker.peers.transport
    real_write = transport.write
    refused: list[bytes] = []

    def write(peer: str, src: Any, dst: Any, notif: bytes) -> object:
        if b"d1" in notif:  # every post of d1 (the early launch and the full path)
            refused.append(notif)
            raise PeerGoneError(f"write to {peer}: NIXL_ERR_REMOTE_DISCONNECT")
        return real_write(peer, src, dst, notif)

    transport.write = write  # type: ignore[method-assign]
    pair.p.prefill("p1", "t1", 4)
    pair.register("d1", "t1", 4)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), timeout=5.0, what="D told of the failure")
    assert refused
    reasons = [i for k, r, i in pair.d_events if r == "d1" and k == "failed"]
    assert "could not be posted" in str(reasons)
    pair.p.prefill("p2", "t2", 4)
    pair.register("d2", "t2", 4)
    pair.until(lambda: recv_ok(pair, "d2"), what="the next push, over the new connection")
    pair.settle()
    # D asked no P rank to cancel what had ended: P would answer for a request D forgot.
    assert pair.d.worker.stats["fail_unknown"] == 0


def test_malformed_notifications_do_not_stop_the_writer(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    p_agent = pair.p.worker.info.agent_name
    pair.d.worker.transport.add_peer(p_agent, p_agent.encode())
    for junk in [
        b"",
        b"garbage",
        b"PUSH_REG:\x00\x01",
        b"nope:0",
        b"PUSH_HB:\xc1",
        wire.encode(wire.Completion("unknown-request", 1)),
    ]:
        pair.d.worker.transport.send_notif(p_agent, junk)
    pair.until(lambda: pair.p.worker.stats["rejected"] == 5, what="5 rejections")
    assert pair.p.worker.stats["writer_errors"] == 0
    pair.p.prefill("p1", "t1", 2)
    pair.register("d1", "t1", 2)
    pair.until(lambda: recv_ok(pair, "d1"), what="the writer still pushes")


@pytest.mark.parametrize(
    "p_kw, d_kw, why",
    [
        ({"block_bytes": 8192}, {}, "page size"),
        ({"layers": 6}, {}, "layer4.k is not advertised"),
        ({"shape": RankShape(pp_size=2, pp_rank=0, packed=True)}, {}, "one side has packed rows"),
    ],
    ids=["page-size", "missing-layer", "packed-vs-flat"],
)
def test_handshake_refuses_incompatible_layouts(
    pair_factory: Callable[..., Pair], p_kw: dict[str, Any], d_kw: dict[str, Any], why: str
) -> None:
    pair = pair_factory(p_kw=p_kw, d_kw=d_kw)
    pair.register("d1", "t1", 2)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="refused registration")
    reason = next(i["reason"] for k, _, i in pair.d_events if k == "failed")
    assert "incompatible" in reason and why in reason, reason
    assert pair.p.worker.stats["writes"] == 0


def test_cancel_after_the_outcome_reports_nothing_more(pair_factory: Callable[..., Pair]) -> None:
    """vLLM asserts a finished receive is reported once: a cancel that arrives after the
    receive already failed (its report not yet collected) must not add a "released"."""
    from kvpush.core.types import RecvRegistration

    pair = pair_factory()
    worker = pair.d.worker
    dead = free_port()  # nobody answers there: the handshake fails after its timeout

    def reg(rid: str) -> StepMeta:
        return StepMeta(registrations=[RecvRegistration(rid, [[1]], "P", "127.0.0.1", dead)])

    seen: list[tuple[str, str]] = []

    def collected(what: tuple[str, str]) -> bool:
        out = worker.get_finished()
        seen.extend(("failed", r) for r in out.failed_recving)
        seen.extend(("released", r) for r in out.released)
        seen.extend(("recv", r) for r in out.finished_recving)
        return what in seen

    worker.start_step(reg("r1"))
    wait_until(lambda: collected(("failed", "r1")), 10, what="r1 to fail")
    worker.start_step(StepMeta(cancels=["r1"]))  # an abort decided before that report
    worker.start_step(reg("marker"))  # same FIFO: once it ends, the cancel was handled
    wait_until(lambda: collected(("failed", "marker")), 10, what="the marker to fail")
    assert [s for s in seen if s[1] == "r1"] == [("failed", "r1")], seen


def test_a_dead_side_channel_fails_the_engines_next_step(
    pair_factory: Callable[..., Pair],
) -> None:
    w = pair_factory().d.worker
    w._server._frames.running = False  # as its thread leaves it (frames.FrameServer._run)
    with pytest.raises(KVPushError, match="side channel thread is not running"):
        w.start_step(StepMeta(cancels=["x"]))


def test_the_engine_thread_ticks_and_idles_cheaply(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    w = pair.p.worker
    assert w._thread.name == "kvpush-keeper" and w.keeper_alive()
    ticks: list[int] = []
    tick = w._tick

    def counted() -> None:
        ticks.append(threading.get_ident())
        tick()

    w._tick = counted  # type: ignore[method-assign]
    pair.register("d1", "t1", 4)
    pair.until(
        lambda: len(w.producer.pending_regs) == 1 and bool(w.peers.by_agent),
        what="registration on P and P connected to D",
    )
    pair.p.prefill("p1", "t1", 4)
    engine_ticks = len(ticks)
    pair.p.step()  # its start_step matches and WRITEs before it returns, on this thread
    assert w.stats["writes"] == 1
    assert ticks[engine_ticks:] and set(ticks[engine_ticks:]) == {threading.get_ident()}
    pair.until(lambda: recv_ok(pair, "d1"), what="verified receive")
    pair.settle()
    # Idle: get_finished reads the clock and returns; a tick only when the idle timer is due.
    before = len(ticks)
    for _ in range(50):
        w.get_finished()
    assert len(ticks) <= before + 1


def test_the_keeper_polls_while_the_engine_makes_no_call(
    pair_factory: Callable[..., Pair],
) -> None:
    """P's engine idle (no call at all): its keeper thread still reads D's
    registration and keeps heartbeats going, so D's watchdog is renewed; once the
    engine calls again, the push goes through."""
    pair = pair_factory(watchdog_s=1.0)
    pair.register("d1", "t1", 4)
    # Only D steps: P's worker hears of the registration from its keeper alone.
    wait_until(lambda: len(pair.p.worker.producer.pending_regs) == 1, 10, pair.d.step, "P's keeper")
    hb = pair.p.worker.stats
    deadline = time.monotonic() + 2.5  # over twice D's watchdog, P's engine silent
    while time.monotonic() < deadline:
        pair.d.step()
        pair.d_events += pair.d.take_events()
        time.sleep(0.01)
    assert "failed" not in pair.d_kinds("d1"), "D's watchdog fired: no heartbeats from P"
    pair.p.prefill("p1", "t1", 4)
    pair.until(lambda: recv_ok(pair, "d1"), what="verified receive")
    assert hb["writes"] == 1


def test_received_bytes_count_each_group_once() -> None:
    """recv_bytes: every region's bytes per logical block times its group's block count
    (per-group sums computed once per worker, not per region per receive)."""
    from types import SimpleNamespace

    from kvpush.core.consumer import Consumer, RecvTransfer
    from kvpush.core.layout import KVLayout, Region
    from kvpush.core.types import RecvRegistration, WorkerConfig

    regions = [
        Region("k0", 0, 64, 100, group=0),
        Region("k1", 1 << 20, 32, 100, group=1),
        Region("v0", 2 << 20, 16, 100, group=0),
    ]
    layout = KVLayout(regions, 16, physical_per_logical=2)
    c = Consumer(SimpleNamespace(layout=layout, config=WorkerConfig("D")))  # type: ignore[arg-type]
    for ids, want in (([[1, 2, 3], [4]], 2 * (3 * 64 + 32 + 3 * 16)), ([[], [5, 6]], 2 * 2 * 32)):
        t = RecvTransfer(RecvRegistration("r", ids, "P", "h", 1))
        assert c._nbytes(t) == want


def kept_back(pair: Pair, rid: str) -> bool:
    """P's push of ``rid`` ended, but its finished_sending waits for the engine's finish."""
    h = pair.p.worker.handed_over(rid)
    return h is not None and h.sent and not h.confirmed


def test_early_hand_over_is_reported_sent_only_once_the_engine_finished_it(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    pair.register("d1", "t1", 4)
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1)
    pair.p.prefill("p1", "t1", 4, early=True)
    pair.until(lambda: recv_ok(pair, "d1"), what="verified receive")
    # The push is over, but P's engine has not finished the request: the blocks stay its.
    pair.until(lambda: kept_back(pair, "p1"), what="finished_sending kept back")
    for _ in range(5):
        pair.step()
    assert "sent" not in pair.p_kinds("p1")
    assert pair.p.sched.handed_over("p1") and pair.p.held_blocks() == 4
    assert not pair.p.sched.hand_over("p1", [[1]])  # already held: refused, nothing changes
    pair.p.finish("p1")
    assert not pair.p.sched.handed_over("p1")
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="finished_sending after the finish")
    pair.settle()
    assert pair.p.worker.stats["handed_over"] == 1
    assert pair.p_kinds("p1").count("sent") == 1


def test_early_hand_over_finished_before_its_push_ends(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    pair.p.prefill("p1", "t1", 3, early=True)
    pair.step()  # handed over; no registration yet
    pair.p.finish("p1")  # confirmed before anything was sent
    pair.step()
    h = pair.p.worker.handed_over("p1")
    assert h is not None and h.confirmed and not h.sent and "sent" not in pair.p_kinds("p1")
    pair.register("d1", "t1", 3)
    pair.until(lambda: recv_ok(pair, "d1"), what="verified receive")
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="finished_sending on P")
    pair.settle()


def test_early_hand_over_past_its_lease_waits_for_the_finish(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory(p_kw={"lease_s": 0.2})
    pair.p.prefill("p1", "t1", 3, early=True)  # no decoder ever registers
    pair.until(lambda: kept_back(pair, "p1"), what="evicted, kept back")
    assert "sent" not in pair.p_kinds("p1") and pair.p.held_blocks() == 3
    pair.p.finish("p1")
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="freed after the finish")
    pair.settle()


def test_memory_transport_releases_one_of_several_pending_writes() -> None:
    """Handles are compared by identity: releasing one of two pending WRITEs to one peer
    (field-wise == on their arrays would raise) leaves the other pending, and it still
    completes."""
    import numpy as np

    from kvpush.core.layout import KVLayout, Region
    from kvpush.core.transport import WriteState

    fabric = Fabric(hold_writes=True)
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8)
    a, b = MemoryTransport(fabric, "A"), MemoryTransport(fabric, "B")
    a.register(KVLayout([Region("r", int(dst.ctypes.data), 64, 4)], 16))
    b.register(KVLayout([Region("r", int(src.ctypes.data), 64, 4)], 16))
    b.add_peer("A", a.metadata())
    one = np.array([[int(src.ctypes.data), 64, 0]], dtype=np.int64)
    two = np.array([[int(dst.ctypes.data), 64, 0]], dtype=np.int64)
    w1 = b.write("A", one, two, b"one")
    w2 = b.write("A", one + [[64, 0, 0]], two + [[64, 0, 0]], b"two")
    b.release(w1)
    assert w1 not in fabric.writes and w2 in fabric.writes
    assert b.check(w2) is WriteState.PENDING
    fabric.complete_writes()
    assert b.check(w2) is WriteState.DONE and (dst[64:128] == src[64:128]).all()
