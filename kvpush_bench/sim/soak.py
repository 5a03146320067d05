"""The soak: N requests between a P and a D process over real NIXL, a fraction faulted.

Each faulted request carries its fault's marker in its ids, so the rules armed on
both processes (``kvpush_bench.sim.faults``) hit exactly the requests chosen for them.
Faults: dropped, duplicated and delayed notifications, failed handshakes, failed
and erroring WRITEs, a reset peer connection, and aborts (plain, during a slow
WRITE, and with the cancel's answer lost). Nothing is killed: the soak asks whether
the survivors of every fault keep serving. It reports, besides the counts:

* ``hung``: requests with no outcome on D, or whose blocks P never freed, by the
  per-request deadline;
* ``leaked_blocks``: blocks still held on P and D once both settled;
* ``crashes``: tick errors (`writer_errors`), dead keeper threads and dead processes.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpush_bench.sim.engine import SimSpec
from kvpush_bench.sim.fault_matrix import free_port
from kvpush_bench.sim.faults import FaultPlan, Rule
from kvpush_bench.sim.process import EngineProcess

D_OUTCOMES = ("recv", "failed", "released", "nospace")


def _m(name: str) -> str:
    return f"~{name}~"


# fault name -> (rules on P, rules on D, harness action: "abort" / "dead_port" / "")
FAULTS: dict[str, tuple[list[Rule], list[Rule], str]] = {
    "drop_reg": ([Rule("recv", "drop", "REG", _m("drop_reg"), 0)], [], ""),
    "dup_reg": ([Rule("recv", "dup", "REG", _m("dup_reg"), 0)], [], ""),
    "delay_reg": ([Rule("recv", "delay", "REG", _m("delay_reg"), 0, delay_s=0.3)], [], ""),
    "drop_completion": ([], [Rule("recv", "drop", "COMPLETION", _m("drop_completion"), 0)], ""),
    "dup_completion": ([], [Rule("recv", "dup", "COMPLETION", _m("dup_completion"), 0)], ""),
    "delay_completion": (
        [],
        [Rule("recv", "delay", "COMPLETION", _m("delay_completion"), 0, delay_s=0.3)],
        "",
    ),
    "send_reg_fails": ([], [Rule("send", "fail", "REG", _m("send_reg_fails"), 0)], ""),
    "write_post_fails": ([Rule("write", "fail", match=_m("write_post_fails"), times=0)], [], ""),
    "write_error": ([Rule("write", "error", match=_m("write_error"), times=0)], [], ""),
    "peer_reset": ([Rule("write", "reset", match=_m("peer_reset"), times=0)], [], ""),
    "handshake_dead_port": ([], [], "dead_port"),
    "abort": ([], [], "abort"),
    "abort_during_write": (
        [Rule("write", "delay", match=_m("abort_during_write"), times=0, delay_s=0.3)],
        [],
        "abort",
    ),
    "abort_ack_lost": ([], [Rule("recv", "drop", "FAIL", _m("abort_ack_lost"), 0)], "abort"),
}


@dataclass
class SoakOptions:
    requests: int = 1000
    fault_rate: float = 0.05
    window: int = 32  # requests in flight at once
    max_blocks: int = 8
    layers: int = 2
    block_bytes: int = 4096
    seed: int = 0
    lease_s: float = 2.0
    watchdog_s: float = 2.0
    heartbeat_s: float = 0.25
    handshake_timeout_s: float = 1.0
    registration_ttl_s: float = 5.0
    late_write_hold_s: float = 1.0  # D's hold on silently expired receives' blocks
    request_timeout_s: float = 20.0  # no outcome by then: hung
    faults: list[str] = field(default_factory=lambda: sorted(FAULTS))  # the menu to draw from
    log_level: str = "ERROR"


@dataclass
class _Req:
    i: int
    fault: str
    prid: str
    drid: str
    tid: str
    n: int
    start: float
    d_outcome: str = ""
    p_sent: bool = False


@dataclass
class _Tally:
    outcomes: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    faulted_completed: int = 0
    clean: int = 0
    clean_completed: int = 0
    corrupted: int = 0
    hung: int = 0
    hung_ids: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # D's failure reasons


def _spec(name: str, o: SoakOptions) -> SimSpec:
    return SimSpec(
        name,
        free_port(),
        layers=o.layers,
        num_blocks=max(1024, 2 * o.window * o.max_blocks),
        block_bytes=o.block_bytes,
        seed=o.seed,
        lease_s=o.lease_s,
        watchdog_s=o.watchdog_s,
        faults=FaultPlan(),
        worker={
            "heartbeat_interval_s": o.heartbeat_s,
            "handshake_timeout_s": o.handshake_timeout_s,
            "registration_ttl_s": o.registration_ttl_s,
            "late_write_hold_s": o.late_write_hold_s,
        },
    )


def run_soak(opts: SoakOptions) -> dict[str, Any]:
    unknown = set(opts.faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
    p = EngineProcess(_spec("soak-P", opts), opts.log_level)
    d = EngineProcess(_spec("soak-D", opts), opts.log_level)
    try:
        p.wait_ready()
        d.wait_ready()
        p.send("faults", FaultPlan([r for rules, _, _ in FAULTS.values() for r in rules]))
        d.send("faults", FaultPlan([r for _, rules, _ in FAULTS.values() for r in rules]))
        return _drive(opts, p, d)
    finally:
        p.kill()
        d.kill()


def _start(
    opts: SoakOptions, rng: random.Random, i: int, p: EngineProcess, d: EngineProcess
) -> _Req:
    fault = rng.choice(opts.faults) if opts.faults and rng.random() < opts.fault_rate else ""
    tag = f"s{i}{_m(fault) if fault else '-'}"
    r = _Req(i, fault, f"{tag}p", f"{tag}d", f"{tag}t", rng.randint(1, opts.max_blocks), 0.0)
    r.start = time.monotonic()
    action = FAULTS[fault][2] if fault else ""
    port = free_port() if action == "dead_port" else p.spec.port  # nothing listens there
    reg = ("register", r.drid, r.tid, r.n, p.spec.engine_id, p.spec.host, port)
    if rng.random() < 0.5:
        p.send("prefill", r.prid, r.tid, r.n)
        d.send(*reg)
    else:
        d.send(*reg)
        p.send("prefill", r.prid, r.tid, r.n)
    if action == "abort":
        d.send("abort", r.drid)
    return r


def _drive(opts: SoakOptions, p: EngineProcess, d: EngineProcess) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    t0 = time.monotonic()
    todo = iter(range(opts.requests))
    inflight: dict[str, _Req] = {}  # D request id -> request
    by_prid: dict[str, _Req] = {}
    tally = _Tally()
    crashed = ""
    started = 0
    while True:
        while started < opts.requests and len(inflight) < opts.window:
            r = _start(opts, rng, next(todo), p, d)
            started += 1
            inflight[r.drid] = r
            by_prid[r.prid] = r
            if r.fault:
                tally.faults[r.fault] = tally.faults.get(r.fault, 0) + 1
        if not inflight:
            break
        for kind, rid, _ in p.pump(0.002):
            if kind == "sent" and rid in by_prid:
                by_prid[rid].p_sent = True
        for kind, rid, info in d.pump(0.002):
            if kind in D_OUTCOMES and rid in inflight and not inflight[rid].d_outcome:
                inflight[rid].d_outcome = kind
                tally.corrupted += kind == "recv" and info["bad_regions"] > 0
                if kind == "failed":
                    why = f"{'faulted' if inflight[rid].fault else 'clean'}: {_reason(info)}"
                    tally.reasons[why] = tally.reasons.get(why, 0) + 1
        now = time.monotonic()
        for rid, r in list(inflight.items()):
            if r.d_outcome and r.p_sent:
                _done(tally, r)
            elif now - r.start > opts.request_timeout_s:
                tally.hung += 1
                tally.hung_ids.append(f"{rid}:{r.d_outcome or '-'}:{'sent' if r.p_sent else '-'}")
            else:
                continue
            del inflight[rid]
            del by_prid[r.prid]
        if not (p.proc.is_alive() and d.proc.is_alive()):
            crashed = "P" if not p.proc.is_alive() else "D"
            tally.hung += len(inflight)
            break
        p.events.clear()
        d.events.clear()
    elapsed = time.monotonic() - t0
    return _summary(opts, p, d, tally, elapsed, crashed)


def _reason(info: dict[str, Any]) -> str:
    """A failure reason without the ids and addresses in it."""
    words = str(info.get("reason", "")).split(":")[0].split()
    return " ".join("<id>" if any(c.isdigit() for c in w) else w for w in words)[:60]


def _done(tally: _Tally, r: _Req) -> None:
    tally.outcomes[r.d_outcome] = tally.outcomes.get(r.d_outcome, 0) + 1
    ok = r.d_outcome == "recv"
    if r.fault:
        tally.faulted_completed += ok
    else:
        tally.clean += 1
        tally.clean_completed += ok


def _settle(p: EngineProcess, d: EngineProcess, timeout: float) -> list[dict[str, Any]]:
    """Both sides' stats once they hold no blocks (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [proc.stats() for proc in (p, d) if proc.proc.is_alive()]
        settled = all(s["held_blocks"] == 0 for s in stats)
        if settled or time.monotonic() > deadline:
            return stats
        p.pump(0.05)


def _summary(
    opts: SoakOptions,
    p: EngineProcess,
    d: EngineProcess,
    tally: _Tally,
    elapsed: float,
    crashed: str,
) -> dict[str, Any]:
    stats = _settle(p, d, opts.lease_s + opts.watchdog_s + 10)
    dead = sum(not proc.proc.is_alive() for proc in (p, d))
    writer_errors = sum(int(s.get("writer_errors", 0)) for s in stats)
    writers_dead = sum(not s.get("writer_alive", True) for s in stats)
    completed = tally.outcomes.get("recv", 0) - tally.corrupted
    faulted = sum(tally.faults.values())
    fired: dict[str, int] = {}
    for s in stats:
        for k, v in s.get("faults", {}).items():
            fired[k] = fired.get(k, 0) + v
    return {
        "requests": opts.requests,
        "fault_rate": opts.fault_rate,
        "completed": completed,
        "failed": tally.outcomes.get("failed", 0) + tally.outcomes.get("nospace", 0),
        "released": tally.outcomes.get("released", 0),
        "corrupted": tally.corrupted,
        "hung": tally.hung,
        "leaked_blocks": sum(int(s["held_blocks"]) for s in stats),
        "crashes": writer_errors + writers_dead + dead,
        "completion_rate": round(completed / max(1, opts.requests), 4),
        "clean_completion_rate": round(tally.clean_completed / max(1, tally.clean), 4),
        "faulted_requests": faulted,
        "faulted_completed": tally.faulted_completed,
        "faults": dict(sorted(tally.faults.items())),
        "faults_fired": dict(sorted(fired.items())),
        "failure_reasons": dict(sorted(tally.reasons.items(), key=lambda kv: -kv[1])),
        "writes": int(stats[0].get("writes", 0)) if stats else 0,
        "writer_errors": writer_errors,
        "dead_processes": dead,
        "crashed": crashed,
        "hung_sample": tally.hung_ids[:10],
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(opts.requests / max(elapsed, 1e-9), 1),
        "options": asdict(opts),
    }
