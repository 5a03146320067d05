"""D's hold on the blocks of a receive its watchdog failed while P could still write
(core/late_writes.py): the consumer stepped by hand (no thread, explicit clock), the
scheduler's side of it, and the hold's default from the kernel's TCP setting."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.late_writes import kernel_hold_s, tcp_give_up_s
from kvpush.core.scheduler import PushScheduler, SchedulerConfig
from kvpush.core.types import RecvRegistration, State, WorkerConfig, WorkerOutput
from kvpush.core.wire import Completion
from kvpush.vllm.config import ConnectorOptions
from tests.unit.test_transfer_states import stepped_d


def test_give_up_time_follows_the_kernels_model() -> None:
    assert tcp_give_up_s(3) == 3.0  # 0.2 + 0.4 + 0.8 + 1.6
    assert tcp_give_up_s(15) == 924.6  # the doubling stops at 120 s
    assert tcp_give_up_s(0) == 0.2
    with pytest.raises(ValueError):
        tcp_give_up_s(-1)


def test_default_hold_reads_tcp_retries2(tmp_path: Path) -> None:
    setting = tmp_path / "tcp_retries2"
    setting.write_text("5\n")
    assert kernel_hold_s(str(setting)) == tcp_give_up_s(5)
    setting.write_text("garbage")
    assert kernel_hold_s(str(setting)) == 924.6  # unreadable: the kernel's default, 15
    assert kernel_hold_s(str(tmp_path / "missing")) == 924.6


def test_expiry_with_a_source_still_writing_fails_now_and_holds_the_blocks() -> None:
    c, w, t = stepped_d(1, hold_s=5.0)
    start = time.monotonic()
    c.on_item(("cancel", "d1", True))  # the watchdog, P0 silent: its cancel went out
    assert t.state is State.EXPIRED and w.events == [("held", "d1")]
    assert w.blocks["d1"] == [[1, 2]]  # for vLLM's failed-load report
    assert w.stats["recv_held"] == 1 and w.stats["recv_expired"] == 1
    c.on_completion("P0", Completion("d1", 2))  # the link healed: P's WRITE did land
    assert w.stats["completion_held"] == 1 and w.stats["completion_unknown"] == 0
    c.on_timer(start + 4.0)
    assert w.events == [("held", "d1")]  # still held
    c.on_timer(start + 6.0)
    assert w.events == [("held", "d1"), ("released", "d1")] and not c.holds
    c.on_timer(start + 7.0)
    assert len(w.events) == 2  # released once


def test_expiry_holds_nothing_when_no_source_can_write() -> None:
    # The cancel cannot reach P0 (its connection failed): nothing of it can land.
    c, w, t = stepped_d(1, hold_s=5.0)
    w.notify = lambda agent, msg: False  # type: ignore[method-assign]
    c.on_item(("cancel", "d1", True))
    assert w.events == [("failed", "d1")] and not c.holds
    # And with the hold off, a silent source fails the receive as before.
    c, w, t = stepped_d(1, hold_s=0.0)
    c.on_item(("cancel", "d1", True))
    assert w.events == [("failed", "d1")] and not c.holds


def test_scheduler_keeps_a_held_failure_until_released() -> None:
    s = PushScheduler(SchedulerConfig(lease_s=10.0, watchdog_s=5.0))
    for rid in ("d1", "d2"):
        s.add_registration(RecvRegistration(rid, [[1, 2]], "P", "h", 7), now=0.0)
    s.build_meta(now=0.0)
    assert s.build_meta(now=5.0).expired == ["d1", "d2"]
    assert s.abort("d2")  # the client left first: vLLM finished it, blocks ours
    failed = {"d1": "watchdog", "d2": "watchdog"}
    held = {"d1": [[1, 2]], "d2": [[1, 2]]}
    kept = s.update(WorkerOutput(failed_recving=failed, held=held), now=5.0)
    assert kept.failed_recving == {"d1": "watchdog"} and not kept.released
    assert kept.held == held
    assert s.has_pending_push_work()  # the engine keeps stepping to hear the release
    assert s.abort("d1")  # vLLM finishes the failed request: keep its blocks
    assert not s.build_meta(now=100.0).cancels  # no registration left to cancel
    kept = s.update(WorkerOutput(released={"d1", "d2"}), now=20.0)
    assert kept.released == {"d1", "d2"} and not s.has_pending_push_work()


def test_hold_option_is_checked() -> None:
    assert ConnectorOptions.parse({}).hold_s is None  # auto: the kernel's give-up time
    assert ConnectorOptions.parse({"late_write_hold_s": 3}).hold_s == 3.0
    for bad in ("soon", -1, "nan"):
        with pytest.raises(ConfigError, match="late_write_hold_s"):
            ConnectorOptions.parse({"late_write_hold_s": bad})
    with pytest.raises(ConfigError, match="late_write_hold_s"):
        WorkerConfig("D", late_write_hold_s=-1.0)


def test_worker_side_reports_a_hold_as_failed_blocks_then_finished() -> None:
    """vLLM's contract for a failed async load: the blocks as load errors no later than
    the step the id comes back finished. A held receive's blocks go now (the request ends
    under the "fail" policy), its id only once the hold ended (vLLM frees the blocks then)."""
    from kvpush.core.types import StepMeta
    from kvpush.vllm.worker_side import WorkerSide

    results = [WorkerOutput(failed_recving={"r1": "watchdog"}, held={"r1": [[4, 5]]})]

    class FakeWorker:
        def start_step(self, meta: StepMeta) -> None:
            pass

        def get_finished(self) -> WorkerOutput:
            return results.pop(0) if results else WorkerOutput()

    side = WorkerSide("D", ConnectorOptions.parse({}, env={}), 0, 1)
    side.worker = FakeWorker()  # type: ignore[assignment]
    report = side.collect()
    assert report.failed == {"r1": "watchdog"} and not report.finished_recving
    assert side.take_load_errors() == {4, 5} and side.take_load_errors() == set()
    meta = side.take_meta()
    assert meta is not None and meta.held == {"r1"}
    results.append(WorkerOutput(released={"r1"}))
    assert side.collect().finished_recving == {"r1"} and side.take_load_errors() == set()


def test_a_hold_ends_early_once_every_writers_connection_failed() -> None:
    """A dead P cannot write any more: D probes the writers of a hold with an empty
    heartbeat each timer (a failed send marks the peer failed) and releases the hold
    when none is left."""
    from kvpush.core.wire import Heartbeat

    c, w, t = stepped_d(2, hold_s=60.0)
    c.on_item(("cancel", "d1", True))  # both cancels went out: both may still write
    assert w.events == [("held", "d1")]
    now = time.monotonic()
    w.by_agent = {"P0": object(), "P1": object()}
    c.on_timer(now)
    probes = [a for a, m in w.sent if isinstance(m, Heartbeat) and not m.entries]
    assert sorted(probes) == ["P0", "P1"] and len(w.events) == 1
    w.failed["P0"] = None
    c.on_timer(now)
    assert len(w.events) == 1  # P1 may still write
    w.failed["P1"] = None
    c.on_timer(now)
    assert w.events[-1] == ("released", "d1") and not c.holds


def test_a_silent_writer_of_a_hold_is_not_forgotten_by_a_new_registration() -> None:
    """A new registration re-handshakes with silent P ranks (they may have restarted), by
    forgetting them first; a forgotten peer is never probed, so a hold naming it would
    last its whole time (seen: a killed prefiller's blocks on D past 45 s in CI). A
    peer a hold names counts as in use: the registration goes to it as it is, and the
    probe (or that send) finds its connection failed."""
    from kvpush.core.wire import PushReg

    c, w, t = stepped_d(2, hold_s=60.0)
    c.on_item(("cancel", "d1", True))
    assert w.events == [("held", "d1")]
    w.quiet = True
    c.on_item(("reg", RecvRegistration("d2", [[3]], "P", "h", 0, remote_tp_size=2), None))
    assert w.forgotten == []
    regs = sorted(a for a, m in w.sent if isinstance(m, PushReg) and m.request_id == "d2")
    assert regs == ["P0", "P1"]
    w.failed.update({"P0": None, "P1": None})  # the probe (or that send) failed
    c.on_timer(time.monotonic())
    assert ("released", "d1") in w.events


def test_peer_table_remembers_failed_connections_of_known_peers() -> None:
    from tests.unit.test_push_states import Pair, recv_ok

    pair = Pair()
    try:
        pair.p.prefill("p0", "t0", 1)
        pair.register("d0", "t0", 1)
        pair.until(lambda: recv_ok(pair, "d0"), what="a push (D knows P)")
        peers = pair.d.worker.peers
        (agent,) = peers.by_agent
        peers.forget("never-connected", failed=True)
        assert not peers.failed  # says nothing of a connection it never had
        peers.forget(agent, failed=True)
        assert agent in peers.failed
        pair.p.prefill("p1", "t1", 1)
        pair.register("d1", "t1", 1)
        pair.until(lambda: recv_ok(pair, "d1"), what="a push after a fresh handshake")
        assert agent in peers.by_agent and agent not in peers.failed  # connected again
    finally:
        pair.close()
