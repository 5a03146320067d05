"""A registration naming a request P's engine never got (a wrong ``remote_request_id`` or
``transfer_id``, P's leg refused or lost) is refused after ``unknown_request_grace_s``, not
at ``registration_ttl_s`` (core/pairing.py): P's scheduler reports each request's names on
arrival (vLLM's ``on_new_request``). Never one whose request came, came late within the
grace, or whose arrival a long step of P's engine still carries; nothing when P's scheduler
reports no arrivals."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvpush.core.ids import Key
from kvpush.core.pairing import IDLE_S, named
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.scheduler_side import SchedulerSide, p_names, registration
from tests.conftest import wait_until
from tests.unit.test_push_states import Pair, recv_ok
from tests.unit.test_vllm_adapter import FakeRequest

GRACE = 0.5
WORKER = {"registration_ttl_s": 60.0, "unknown_request_grace_s": GRACE}
P_RID, D_RID, D2_RID = "cmpl-p-0-a1b2c3d4", "cmpl-d-0-99ff0011", "cmpl-d2-0-99ff0022"
SIDE = {"remote_host": "127.0.0.1", "remote_port": 5700}


@pytest.fixture
def make() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def build(**kw: object) -> Pair:
        pair = Pair(worker=WORKER, **kw)  # type: ignore[arg-type]
        made.append(pair)
        return pair

    yield build
    for pair in made:
        pair.close()


def reason(pair: Pair, rid: str) -> str:
    return next(str(i["reason"]) for k, r, i in pair.d_events if k == "failed" and r == rid)


def run_for(pair: Pair, seconds: float, step: Callable[[], None] | None = None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        (step or pair.step)()
        time.sleep(0.001)


def test_a_registration_naming_a_request_that_never_came_fails_after_the_grace(
    make: Callable[..., Pair],
) -> None:
    pair = make()
    pair.p.sched.arrived(["cmpl-other-0", "cmpl-gone-0"])  # P's scheduler reports arrivals
    pair.p.sched.departed(["cmpl-gone-0"])  # ... and one that left without a push
    pair.step()
    start = time.monotonic()
    pair.register(D_RID, "cmpl-p-0", 3)  # names P's request (remote_request_id)
    pair.register(D2_RID, "T", 3)  # by a transfer id P never got
    pair.register("cmpl-d3-0-99ff0033", "cmpl-gone-0", 3)
    for rid in (D_RID, D2_RID, "cmpl-d3-0-99ff0033"):
        pair.until(lambda rid=rid: "failed" in pair.d_kinds(rid), timeout=10, what=rid)
    took = time.monotonic() - start
    assert GRACE <= took < 5, took  # (registration_ttl_s is 60 s)
    assert "no request of this prefiller is named 'cmpl-p-0'" in reason(pair, D_RID)
    assert "named 'T'" in reason(pair, D2_RID)
    assert pair.p.worker.stats["reg_unpairable"] == 3
    assert len(pair.p.worker.producer.pending_regs) == 0
    pair.settle()


def test_an_idle_prefiller_refuses_too(make: Callable[..., Pair]) -> None:
    """P's engine takes no step (nothing to do): it would have stepped for a request."""
    pair = make()
    pair.p.sched.arrived(["cmpl-other-0"])
    pair.step()
    start = time.monotonic()
    pair.register(D_RID, "cmpl-p-0", 3)
    wait_until(lambda: "failed" in pair.d_kinds(D_RID), 10, d_only(pair), "D fails")
    assert GRACE + IDLE_S <= time.monotonic() - start < 5
    assert pair.p.worker.stats["reg_unpairable"] == 1


def d_only(pair: Pair) -> Callable[[], None]:
    def step() -> None:
        pair.d.step()
        pair.d_events += pair.d.take_events()

    return step


def test_a_long_step_carrying_the_arrival_is_waited_for(make: Callable[..., Pair]) -> None:
    """P's engine began a step (vLLM bound its metadata) and its forward runs long: the
    arrival it may carry is not known before it ends, so nothing is refused meanwhile."""
    pair = make()
    pair.p.sched.arrived(["cmpl-other-0"])
    pair.step()
    pair.p.worker.producer.pairing.step_began()  # (as KVPushConnector.bind_connector_metadata)
    pair.register(D_RID, "cmpl-p-0", 3)
    run_for(pair, GRACE + IDLE_S + 1.0, d_only(pair))
    assert pair.d_kinds(D_RID) == [] and pair.p.worker.stats["reg_unpairable"] == 0
    pair.p.sched.arrived(p_names(P_RID, {"do_remote_decode": True}))  # the step ends with it
    pair.p.prefill(P_RID, "cmpl-p-0", 3)
    pair.until(lambda: recv_ok(pair, D_RID), what="the receive")
    assert pair.p.worker.stats["reg_unpairable"] == 0
    pair.settle()


@pytest.mark.parametrize("late", [False, True], ids=["came-first", "came-within-grace"])
def test_a_request_that_came_is_waited_for(make: Callable[..., Pair], late: bool) -> None:
    pair = make()
    names = p_names(P_RID, {"do_remote_decode": True})
    pair.p.sched.arrived(["cmpl-other-0"] if late else names)
    pair.step()
    pair.register(D_RID, "cmpl-p-0", 3)
    if late:  # P's leg lags D's registration (P's API server's backlog)
        run_for(pair, GRACE / 2)
        pair.p.sched.arrived(names)
    run_for(pair, 2 * GRACE + IDLE_S)  # past any refusal: its prefill is still running
    assert pair.d_kinds(D_RID) == [] and pair.p.worker.stats["reg_unpairable"] == 0
    pair.p.prefill(P_RID, "cmpl-p-0", 3)
    pair.until(lambda: recv_ok(pair, D_RID), what="the receive")
    pair.settle()


def test_without_arrivals_reported_nothing_is_refused(make: Callable[..., Pair]) -> None:
    """The sim harness, or a P whose scheduler reports none: the registration waits."""
    pair = make()
    pair.register(D_RID, "cmpl-p-0", 3)
    run_for(pair, 2 * GRACE + IDLE_S)
    assert pair.d_kinds(D_RID) == [] and len(pair.p.worker.producer.pending_regs) == 1
    pair.p.prefill(P_RID, "cmpl-p-0", 3)
    pair.until(lambda: recv_ok(pair, D_RID), what="the receive")
    pair.settle()


def test_p_reports_the_names_d_derives_for_each_sub_request() -> None:
    """P's names of each engine request (n > 1 samples, several prompts, chat) hold every
    key D's registration of the same sub-request derives: by transfer id, by
    remote_request_id, by the shared id. Reported at arrival; again when it leaves unpushed."""
    opts = ConnectorOptions.parse({}, env={})
    p = SchedulerSide("P", opts, True, False, 1)
    cases = [  # P's engine request, D's of the same sub-request
        ("cmpl-x-0-a1b2c3d4", "cmpl-y-0-99ff0011", "cmpl-x-0"),
        ("1_cmpl-x-2-a1b2c3d4", "1_cmpl-y-2-99ff0011", "cmpl-x-0"),
        ("chatcmpl-x-a1b2c3d4", "chatcmpl-y-99ff0011", "chatcmpl-x-a1b2c3d4"),
    ]
    for tid in (None, "T"):
        for p_rid, d_rid, remote in cases:
            params = {"do_remote_decode": True, **({"transfer_id": tid} if tid else {})}
            p.on_new_request(FakeRequest(p_rid, params))
            got = p.sched.build_meta().arrived
            assert got == p_names(p_rid, params) and len(set(got)) == len(got)
            d_params = {**SIDE, "remote_request_id": remote}
            if tid:
                d_params["transfer_id"] = tid
            reg = registration(d_rid, d_params, [[1]])
            assert named(Key(d_rid, reg.transfer_id)) in got, (p_rid, reg.transfer_id)
            same_id = p_rid[: -len("a1b2c3d4")] + "99ff0011"  # the same X-Request-Id
            assert named(Key(same_id, None)) in got
            # It leaves without a push (aborted): its names go back.
            p.request_finished(FakeRequest(p_rid, params, status="FINISHED_ABORTED"), [1])
            assert p.sched.build_meta().departed == got
    # Not a P request to push, or not a producer: nothing.
    p.on_new_request(FakeRequest("cmpl-z-0-a1b2c3d4", {}))
    d = SchedulerSide("D", opts, False, True, 1)
    d.on_new_request(FakeRequest("cmpl-z-0-a1b2c3d4", {"do_remote_decode": True}))
    assert not p.sched.build_meta() and not d.sched.build_meta()
