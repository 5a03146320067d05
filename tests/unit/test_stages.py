"""kvpush_bench.stages: trace marks lined up with the client's samples."""

from __future__ import annotations

from types import SimpleNamespace

from kvpush_bench.stages import breakdown, timelines

T0 = 1000.0


def ev(dt_ms: float, ev: str, pid: str, key: str | None = None, rid: str | None = None) -> dict:
    return {"t": T0 + dt_ms / 1e3, "ev": ev, "id": key, "rid": rid, "pid": pid}


EVENTS = [
    ev(1.0, "router.recv", "r", "t1"),
    ev(2.0, "d_sched.alloc", "d", "t1", "cmpl-t1-0-ab"),
    ev(3.0, "sched.step", "d"),  # D's empty step: no transfer
    ev(4.0, "d_worker.report", "dw", None, "cmpl-t1-0-ab"),  # known by request id only
    ev(5.0, "p_sched.alloc", "p", "t1", "cmpl-t1-0-cd"),
    ev(6.0, "sched.step", "p"),
    ev(9.0, "d_sched.alloc", "d", "t2", "cmpl-t2-0-ef"),  # another request, after t1's token
]


def test_stages_and_timelines_follow_the_transfer_from_the_clients_send() -> None:
    sample = SimpleNamespace(request_id="t1", sent_at=T0, ok=True, ttft_s=0.007)
    out = breakdown([sample], EVENTS)
    assert out["traced_requests"] == 1
    offsets = {k: v["median"] for k, v in out["offset_ms"].items()}
    assert offsets == {
        "router.recv": 1.0,
        "p_sched.alloc": 5.0,
        "d_sched.alloc": 2.0,
        "d_worker.report": 4.0,  # tied to t1 through d_sched.alloc's request id
        "client.first_token": 7.0,
    }
    (rows,) = timelines([sample], EVENTS)
    assert [r[2] for r in rows] == [
        "router.recv",
        "d_sched.alloc",
        "sched.step",
        "d_worker.report",
        "p_sched.alloc",
        "sched.step",
        "first_token",
    ]
    sides = {r[2] + str(r[0]): r[1] for r in rows}
    assert sides["sched.step3.0"] == "D" and sides["sched.step6.0"] == "P"
    assert sides["router.recv1.0"] == "router"


def test_failed_and_untraced_samples_are_left_out() -> None:
    failed = SimpleNamespace(request_id="t1", sent_at=T0, ok=False, ttft_s=0.0)
    unknown = SimpleNamespace(request_id="nope", sent_at=T0, ok=True, ttft_s=0.01)
    assert breakdown([failed, unknown], EVENTS)["traced_requests"] == 0
    assert timelines([failed, unknown], EVENTS) == []


def test_the_second_token_extends_the_timeline_and_has_its_own_stage() -> None:
    late_step = ev(9.5, "sched.step", "d")  # D's step that makes the second token
    events = [*EVENTS, late_step]
    sample = SimpleNamespace(request_id="t1", sent_at=T0, ok=True, ttft_s=0.007, second_s=0.01)
    out = breakdown([sample], events)["offset_ms"]
    assert list(out)[-2:] == ["client.first_token", "client.second_token"]
    assert out["client.second_token"]["median"] == 10.0
    (rows,) = timelines([sample], events)
    names = [r[2] for r in rows]
    assert names[-3:] == ["first_token", "sched.step", "second_token"]  # in time order
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert "d_sched.alloc" not in names[names.index("first_token") :]  # t2's stays out
