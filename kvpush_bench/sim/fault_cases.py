"""The cases of the fault matrix: a fault (or a kill) at each protocol point.

Each driver arms rules matched by the case's marker, starts its request and returns
the time the fault struck (taken before the request starts when the fault fires
inside a process, so measured times are upper bounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpush_bench.sim.fault_matrix import Case, Ids, Matrix
from kvpush_bench.sim.faults import Rule

WRITE_DELAY_S = 1.0  # how long a "slow" WRITE stays in flight
CASES: list[Case] = []
Driver = Callable[[Matrix, Ids], float]


def case(
    point: str, victim: str, expect: str, write: str, bound: str, fresh: str = ""
) -> Callable[[Driver], Driver]:
    """Register a driver as a case; its docstring says what is injected.

    ``victim``: who dies ("P", "D" or ""); ``expect``: D's outcome (completed, failed,
    released, "D died"; "|" separates accepted ones); ``write``: P's WRITE (done, none,
    failed, any); ``bound``: blocks back to zero by then (now, lease, watchdog, hold, sums);
    ``fresh``: the side ("P" or "D") that starts as a new process, never reached before.
    """

    def add(fn: Driver) -> Driver:
        doc = " ".join((fn.__doc__ or "").split())
        CASES.append(Case(fn.__name__, point, doc, victim, expect, write, bound, fn, fresh))
        return fn

    return add


def _now() -> float:
    return time.monotonic()


def _arm_and_push(m: Matrix, c: Ids, side: str, rule: Rule) -> float:
    m.arm(m.p if side == "P" else m.d, [rule])
    t = _now()
    m.push(c)
    return t


# ---- kills at protocol points ----------------------------------------------------------


@case("before registration", "D", "D died", "none", "lease")
def kill_d_before_reg(m: Matrix, c: Ids) -> float:
    """SIGKILL D as it sends PUSH_REG; P's prefill ends."""
    return _arm_and_push(m, c, "D", Rule("send", "kill", "REG", c.marker))


@case("before registration", "P", "failed", "any", "watchdog")
def kill_p_before_reg(m: Matrix, c: Ids) -> float:
    """SIGKILL P, then D registers with it."""
    t = _now()
    m.p.kill()
    m.register(c)
    return t


@case("after registration, before P's blocks", "D", "D died", "any", "lease")
def kill_d_after_reg(m: Matrix, c: Ids) -> float:
    """SIGKILL D once P holds its PUSH_REG; then P's prefill ends."""
    m.register(c)
    m.wait_stat(m.p, "pending_registrations", 1)
    t = _now()
    m.d.kill()
    m.prefill(c)
    return t


@case("after registration, before P's blocks", "P", "failed", "any", "watchdog")
def kill_p_after_reg(m: Matrix, c: Ids) -> float:
    """SIGKILL P once it holds D's PUSH_REG."""
    m.register(c)
    m.wait_stat(m.p, "pending_registrations", 1)
    t = _now()
    m.p.kill()
    return t


@case("after the match, before the WRITE", "P", "failed", "any", "watchdog")
def kill_p_in_write(m: Matrix, c: Ids) -> float:
    """SIGKILL P inside write(), before posting."""
    return _arm_and_push(m, c, "P", Rule("write", "kill", match=c.marker))


@case("during the WRITE", "P", "completed|failed", "any", "watchdog")
def kill_p_after_post(m: Matrix, c: Ids) -> float:
    """SIGKILL P right after posting the WRITE."""
    return _arm_and_push(m, c, "P", Rule("posted", "kill", match=c.marker))


@case("during the WRITE", "D", "D died", "any", "lease")
def kill_d_during_write(m: Matrix, c: Ids) -> float:
    """The WRITE stays in flight 1 s; SIGKILL D meanwhile."""
    m.arm(m.p, [Rule("write", "delay", match=c.marker, delay_s=WRITE_DELAY_S)])
    m.push(c)
    m.wait_stat(m.p, "writing", 1)
    t = _now()
    m.d.kill()
    return t


@case("before D counts the completion", "D", "D died", "done", "now")
def kill_d_on_completion(m: Matrix, c: Ids) -> float:
    """SIGKILL D when get_notifs returns the completion."""
    return _arm_and_push(m, c, "D", Rule("recv", "kill", "COMPLETION", c.marker))


# ---- notifications ---------------------------------------------------------------------


@case("registration", "", "failed", "none", "watchdog+lease")
def drop_reg(m: Matrix, c: Ids) -> float:
    """Drop PUSH_REG at P."""
    return _arm_and_push(m, c, "P", Rule("recv", "drop", "REG", c.marker))


@case("registration", "", "completed", "done", "now")
def dup_reg(m: Matrix, c: Ids) -> float:
    """Deliver PUSH_REG twice."""
    return _arm_and_push(m, c, "P", Rule("recv", "dup", "REG", c.marker))


@case("registration", "", "completed", "done", "now")
def delay_reg(m: Matrix, c: Ids) -> float:
    """Delay PUSH_REG 0.5 s."""
    return _arm_and_push(m, c, "P", Rule("recv", "delay", "REG", c.marker, delay_s=0.5))


@case("registration", "", "completed", "done", "now")
def reorder_reg_behind_hb(m: Matrix, c: Ids) -> float:
    """Hold PUSH_REG at P until a heartbeat overtakes it."""
    rule = Rule("recv", "reorder", "REG", c.marker, delay_s=5.0, after_kind="HB")
    return _arm_and_push(m, c, "P", rule)


@case("completion", "", "failed", "done", "watchdog+hold")
def drop_completion(m: Matrix, c: Ids) -> float:
    """Drop the completion at D."""
    return _arm_and_push(m, c, "D", Rule("recv", "drop", "COMPLETION", c.marker))


@case("completion", "", "completed", "done", "now")
def dup_completion(m: Matrix, c: Ids) -> float:
    """Deliver the completion twice."""
    return _arm_and_push(m, c, "D", Rule("recv", "dup", "COMPLETION", c.marker))


@case("completion", "", "completed", "done", "now")
def delay_completion(m: Matrix, c: Ids) -> float:
    """Delay the completion 0.5 s."""
    return _arm_and_push(m, c, "D", Rule("recv", "delay", "COMPLETION", c.marker, delay_s=0.5))


@case("completion", "", "failed", "done", "watchdog+hold")
def delay_completion_late(m: Matrix, c: Ids) -> float:
    """Delay the completion 1.5 s past D's watchdog."""
    delay = m.opts.watchdog_s + 1.5
    return _arm_and_push(m, c, "D", Rule("recv", "delay", "COMPLETION", c.marker, delay_s=delay))


@case("heartbeats", "", "failed", "none", "watchdog+lease")
def drop_heartbeats(m: Matrix, c: Ids) -> float:
    """Drop every heartbeat both ways; P's prefill ends after D gave up."""
    for proc in (m.p, m.d):
        m.arm(proc, [Rule("recv", "drop", "HB", times=0)])
    t = _now()
    m.register(c)
    m.outcome(m.d, c.drid, m.bound_s("watchdog") + 5)
    m.wait_stat(m.p, "pending_registrations", 0, at_most=True)  # D's PUSH_CANCEL arrived
    m.prefill(c)  # after D gave up: P must not write
    return t


# ---- handshakes, WRITEs, aborts -------------------------------------------------------


@case("handshake", "", "failed", "none", "lease", fresh="P")
def handshake_fail_on_d(m: Matrix, c: Ids) -> float:
    """D's handshake with a new P fails."""
    m.arm(m.d, [Rule("handshake", "fail", match=f":{m.p.spec.port}")])
    t = _now()
    m.register(c)
    m.prefill(c)
    return t


@case("handshake", "", "failed", "none", "watchdog+hold", fresh="D")
def handshake_fail_on_p(m: Matrix, c: Ids) -> float:
    """P's handshake with a new D fails."""
    m.arm(m.p, [Rule("handshake", "fail", match=f":{m.d.spec.port}")])
    t = _now()
    m.prefill(c)
    m.wait_stat(m.p, "staged", 1)
    m.register(c)
    return t


@case("WRITE", "", "failed", "failed", "now")
def write_post_fails(m: Matrix, c: Ids) -> float:
    """Posting the WRITE raises."""
    return _arm_and_push(m, c, "P", Rule("write", "fail", match=c.marker))


@case("WRITE", "", "failed", "failed", "now")
def write_post_finds_peer_gone(m: Matrix, c: Ids) -> float:
    """Posting the WRITE finds the connection to D broken (P forgets D; its PUSH_FAIL
    goes over a fresh handshake)."""
    return _arm_and_push(m, c, "P", Rule("write", "gone", match=c.marker))


@case("WRITE", "", "failed", "failed", "now")
def write_ends_in_error(m: Matrix, c: Ids) -> float:
    """The WRITE ends in ERROR."""
    return _arm_and_push(m, c, "P", Rule("write", "error", match=c.marker))


@case("abort", "", "released", "none", "lease")
def abort_before_match(m: Matrix, c: Ids) -> float:
    """D aborts while P holds only its PUSH_REG; P's prefill ends after."""
    m.register(c)
    m.wait_stat(m.p, "pending_registrations", 1)
    t = _now()
    m.abort(c)
    m.wait_stat(m.p, "pending_registrations", 0, at_most=True)  # the cancel arrived
    m.prefill(c)
    return t


@case("abort", "", "released", "done", "now")
def abort_during_write(m: Matrix, c: Ids) -> float:
    """D aborts while the WRITE is in flight (1 s)."""
    m.arm(m.p, [Rule("write", "delay", match=c.marker, delay_s=WRITE_DELAY_S)])
    m.push(c)
    m.wait_stat(m.p, "writing", 1)
    t = _now()
    m.abort(c)
    return t


@case("abort", "", "released", "none", "watchdog+lease")
def drop_cancel_ack(m: Matrix, c: Ids) -> float:
    """D aborts; P's PUSH_FAIL (cancelled) is dropped; P's prefill ends after."""
    m.arm(m.d, [Rule("recv", "drop", "FAIL", c.marker)])
    m.register(c)
    m.wait_stat(m.p, "pending_registrations", 1)
    t = _now()
    m.abort(c)
    m.wait_stat(m.p, "pending_registrations", 0, at_most=True)  # the cancel arrived
    m.prefill(c)  # a late prefill must not write into the aborted blocks
    return t


@case("abort", "", "released", "none", "lease")
def reorder_cancel_before_reg(m: Matrix, c: Ids) -> float:
    """D registers and aborts at once; P sees PUSH_CANCEL before PUSH_REG."""
    m.arm(m.p, [Rule("recv", "reorder", "REG", c.marker, delay_s=5.0, after_kind="CANCEL")])
    t = _now()
    m.register(c)
    m.abort(c)
    m.prefill(c)
    return t
