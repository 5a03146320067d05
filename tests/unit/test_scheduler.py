"""PushScheduler stepped by hand: an explicit clock (``now=``), no worker, no thread."""

from __future__ import annotations

from kvpush.core.scheduler import PushScheduler, SchedulerConfig
from kvpush.core.types import RecvRegistration, WorkerOutput


def sched() -> PushScheduler:
    return PushScheduler(SchedulerConfig(lease_s=10.0, watchdog_s=5.0))


def reg(rid: str) -> RecvRegistration:
    return RecvRegistration(rid, [[1, 2]], "P", "h", 7)


def test_p_holds_until_sent_and_evicts_once_at_lease_expiry() -> None:
    s = sched()
    assert s.request_finished("p1", [[1, 2, 3]], "t1", now=0.0)
    meta = s.build_meta(now=0.0)
    assert [f.request_id for f in meta.finished] == ["p1"] and s.held_blocks() == 3
    assert not s.build_meta(now=9.9)  # nothing new, nothing due
    assert s.build_meta(now=10.0).evictions == ["p1"]
    assert not s.build_meta(now=20.0).evictions  # asked once
    assert s.has_pending_push_work()  # the blocks stay held until the worker says sent
    kept = s.update(WorkerOutput(finished_sending={"p1", "unknown"}), now=20.0)
    assert kept.finished_sending == {"p1"} and s.held_blocks() == 0
    assert not s.has_pending_push_work()


def test_heartbeats_renew_the_lease_but_not_once_evicting() -> None:
    s = sched()
    s.request_finished("p1", [[1]], now=0.0)
    s.build_meta(now=0.0)
    assert s.update(WorkerOutput(renewed={"p1"}), now=8.0).renewed == {"p1"}
    assert not s.build_meta(now=12.0).evictions  # renewed to 18
    assert s.build_meta(now=18.0).evictions == ["p1"]
    assert not s.update(WorkerOutput(renewed={"p1"}), now=19.0).renewed


def test_early_hand_over_is_confirmed_by_request_finished() -> None:
    s = sched()
    assert s.hand_over("p1", [[4, 5]], "t1", now=0.0)
    assert not s.hand_over("p1", [[4, 5]], now=0.0)  # already held: refused
    assert [e.request_id for e in s.build_meta(now=0.0).early] == ["p1"]
    assert s.handed_over("p1")
    assert s.request_finished("p1", [[4, 5]], now=1.0)  # only confirms
    meta = s.build_meta(now=1.0)
    assert meta.confirmed == ["p1"] and not meta.finished and not s.handed_over("p1")
    assert s.held_blocks() == 2


def test_d_watchdog_expires_once_and_the_failure_is_kept() -> None:
    s = sched()
    s.add_registration(reg("d1"), now=0.0)
    s.add_registration(reg("d1"), now=0.0)  # twice: ignored
    assert len(s.build_meta(now=0.0).registrations) == 1
    assert s.update(WorkerOutput(renewed={"d1"}), now=4.0).renewed == {"d1"}
    assert not s.build_meta(now=8.0).expired  # renewed to 9
    assert s.build_meta(now=9.0).expired == ["d1"]
    assert not s.build_meta(now=30.0).expired
    assert not s.update(WorkerOutput(finished_recving={"d1"}), now=30.0)  # too late: ignored
    kept = s.update(WorkerOutput(failed_recving={"d1": "watchdog"}), now=30.0)
    assert kept.failed_recving == {"d1": "watchdog"} and not s.has_pending_push_work()


def test_abort_of_a_live_request_cancels_and_waits_for_released() -> None:
    s = sched()
    s.add_registration(reg("d1"), now=0.0)
    s.build_meta(now=0.0)
    assert s.abort("d1") and s.abort("d1")  # the second: same answer, no second cancel
    assert s.build_meta(now=0.0).cancels == ["d1"]
    assert not s.abort("never-registered")
    assert s.update(WorkerOutput(released={"d1"}), now=1.0).released == {"d1"}
    assert not s.has_pending_push_work()


def test_abort_as_the_kv_lands_or_after_expiry_hands_the_blocks_back_once() -> None:
    s = sched()
    s.add_registration(reg("expired"), now=0.0)
    s.add_registration(reg("landed"), now=1.0)
    s.build_meta(now=1.0)
    assert s.build_meta(now=5.0).expired == ["expired"]
    assert s.abort("landed") and s.abort("expired")
    assert s.build_meta(now=5.0).cancels == ["landed"]  # the expired one has no registration
    kept = s.update(
        WorkerOutput(finished_recving={"landed"}, failed_recving={"expired": "x"}), now=6.0
    )
    assert kept.released == {"landed", "expired"} and not kept.finished_recving
    assert not kept.failed_recving and not s.has_pending_push_work()


def test_a_rejected_request_fails_through_the_worker() -> None:
    s = sched()
    s.reject("d1", "bad parameters")
    assert s.build_meta(now=0.0).rejected == {"d1": "bad parameters"}
    assert s.has_pending_push_work()
    kept = s.update(WorkerOutput(failed_recving={"d1": "bad parameters"}), now=0.0)
    assert kept.failed_recving == {"d1": "bad parameters"} and not s.has_pending_push_work()
