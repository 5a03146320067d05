"""The fault matrix: one P and one D process over real NIXL, a fault per case.

Each case arms a fault (``kvpush_bench.sim.faults``) on P or D, or kills one of them at a
protocol point, pushes one request and checks: D's outcome is the expected one, the
blocks of every surviving side are back to zero within the lease / watchdog, and the
survivor still serves: a replacement peer is started for a dead one and two more
requests are pushed and verified byte for byte. Cases live in ``fault_cases``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.deploy.servers import free_port
from kvpush_bench.sim.engine import SimSpec
from kvpush_bench.sim.faults import FaultPlan, Rule
from kvpush_bench.sim.process import EngineProcess

OUTCOMES = ("recv", "failed", "released", "nospace")
NAMES = {"recv": "completed", "failed": "failed", "released": "released", "nospace": "no space"}
NOTE_STATS = (
    "reg_duplicate",
    "reg_after_cancel",
    "reg_invalid",
    "completion_unknown",
    "recv_held",
    "completion_held",
    "fail_unknown",
    "handshake_failed",
    "notice_handshake_failed",
    "write_failed",
    "notify_failed",
)


@dataclass
class MatrixOptions:
    lease_s: float = 1.5
    watchdog_s: float = 1.5
    heartbeat_s: float = 0.25
    handshake_timeout_s: float = 1.0
    registration_ttl_s: float = 4.0
    # D keeps the blocks of a receive its watchdog failed while P could still write
    # (kvpush/core/late_writes.py): short here, so the cases' bounds stay short.
    late_write_hold_s: float = 1.0
    slack_s: float = 2.0  # added to every bound: heartbeat period, steps, 2 shared cores
    blocks: int = 4  # blocks per request
    log_level: str = "ERROR"


@dataclass
class Ids:
    """A case's request ids; the marker in every id lets a rule pick this request only."""

    name: str

    @property
    def marker(self) -> str:
        return f"~{self.name}~"

    @property
    def prid(self) -> str:
        return f"{self.marker}p"

    @property
    def drid(self) -> str:
        return f"{self.marker}d"

    @property
    def tid(self) -> str:
        return f"{self.marker}t"


@dataclass
class Case:
    name: str
    point: str  # protocol point, for the matrix
    fault: str  # what is injected
    victim: str  # "P", "D" or "" (who dies)
    expect: str  # D's expected outcome: completed | failed | released | D died, "|" = either
    expect_write: str  # P's WRITE: done | none | failed | any
    bound: str  # "now", "lease", "watchdog", "watchdog+lease": blocks back to zero by then
    drive: Callable[[Matrix, Ids], float] = field(repr=False)  # returns when the fault struck
    fresh: str = ""  # "P" or "D": start the case with a new process there (never reached)


class Matrix:
    """Holds the P/D pair (replacing dead ones) and runs cases one after the other."""

    def __init__(self, opts: MatrixOptions | None = None) -> None:
        self.opts = opts or MatrixOptions()
        self.procs: list[EngineProcess] = []
        self._n = 0
        self._spare: EngineProcess | None = None
        self.p = self.take()
        self.d = self.take()
        self.push_and_check(Ids("warmup"))

    # ---- processes -----------------------------------------------------------------------

    def _spawn(self) -> EngineProcess:
        o = self.opts
        self._n += 1
        spec = SimSpec(
            f"m{self._n}",
            free_port(),
            layers=2,
            num_blocks=256,
            block_bytes=4096,
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
        proc = EngineProcess(spec, o.log_level)
        self.procs.append(proc)
        return proc

    def take(self) -> EngineProcess:
        """A ready process; a spare starts in the background for the next replacement."""
        proc = self._spare or self._spawn()
        self._spare = self._spawn()
        proc.wait_ready()
        return proc

    def replace(self, side: str) -> EngineProcess:
        """Give ``side`` ("P" or "D") a fresh process; the old one is stopped if alive."""
        old = self.p if side == "P" else self.d
        if old.proc.is_alive():
            old.stop()
        new = self.take()
        if side == "P":
            self.p = new
        else:
            self.d = new
        return new

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()

    # ---- actions -------------------------------------------------------------------------

    def arm(self, proc: EngineProcess, rules: list[Rule]) -> None:
        proc.send("faults", FaultPlan(rules))

    def prefill(self, c: Ids) -> None:
        self.p.send("prefill", c.prid, c.tid, self.opts.blocks)

    def register(self, c: Ids, port: int | None = None) -> None:
        p = self.p.spec
        self.d.send(
            "register", c.drid, c.tid, self.opts.blocks, p.engine_id, p.host, port or p.port
        )

    def push(self, c: Ids) -> None:
        self.prefill(c)
        self.register(c)

    def abort(self, c: Ids) -> None:
        self.d.send("abort", c.drid)

    def wait_stat(
        self, proc: EngineProcess, key: str, value: int, timeout: float = 10, at_most: bool = False
    ) -> None:
        """Poll ``proc``'s stats until ``key`` is at least (``at_most``: at most) ``value``."""
        deadline = time.monotonic() + timeout
        while True:
            got = proc.stats().get(key, 0)
            if (got <= value) if at_most else (got >= value):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.spec.engine_id}: {key} = {got} after {timeout}s")
            proc.pump(0.01)

    def outcome(self, proc: EngineProcess, rid: str, timeout: float) -> str:
        """D's outcome for ``rid`` ("recv", "failed", ...) or "dead" / "none" (timed out)."""
        try:
            ev = proc.wait_for(lambda e: e[0] in OUTCOMES and e[1] == rid, timeout, rid)
        except TimeoutError:
            return "none"
        except RuntimeError:
            return "dead"
        return str(ev[0])

    def held_zero_at(self, proc: EngineProcess, deadline: float) -> float | None:
        """When ``proc`` held no blocks (monotonic time), or None if not by ``deadline``."""
        while True:
            now = time.monotonic()
            try:
                if proc.stats(timeout=5)["held_blocks"] == 0:
                    return now
            except (TimeoutError, OSError):
                return None
            if now > deadline:
                return None
            proc.pump(0.02)

    def watch_freed(
        self, procs: dict[str, EngineProcess], t_fault: float, deadline: float
    ) -> dict[str, float | None]:
        """Seconds from ``t_fault`` until each side first held no blocks (None: not by then)."""
        freed: dict[str, float | None] = dict.fromkeys(procs)
        while True:
            for side, proc in procs.items():
                if freed[side] is not None:
                    continue
                try:
                    held = proc.stats(timeout=5)["held_blocks"]
                except (TimeoutError, OSError):
                    continue
                if held == 0:
                    freed[side] = round(max(0.0, time.monotonic() - t_fault), 2)
            if all(v is not None for v in freed.values()) or time.monotonic() > deadline:
                return freed
            time.sleep(0.01)  # pacing between polls, not synchronization

    def push_and_check(self, c: Ids, n: int = 2) -> bool:
        """Push ``n`` fresh requests; True if every one arrives verified."""
        subs = [Ids(f"{c.name}-s{i}") for i in range(n)]
        for s in subs:
            self.push(s)
        for s in subs:
            if self.outcome(self.d, s.drid, 30) != "recv":
                return False
        # P counts a WRITE done before it frees its blocks: settled stats for the next case.
        if self.held_zero_at(self.p, time.monotonic() + 10) is None:
            return False
        return all(ev[2]["bad_regions"] == 0 for ev in self.d.events if ev[0] == "recv")

    # ---- one case ------------------------------------------------------------------------

    def bound_s(self, bound: str) -> float:
        o = self.opts
        parts = {
            "now": 0.0,
            "lease": o.lease_s,
            "watchdog": o.watchdog_s,
            "hold": o.late_write_hold_s,
        }
        return sum(parts[b] for b in bound.split("+")) + o.slack_s

    def run(self, case: Case) -> dict[str, Any]:
        ids = Ids(case.name)
        bound = self.bound_s(case.bound)
        if case.fresh:
            self.replace(case.fresh)
        base_p, base_d = self.p.stats(), self.d.stats()
        t0 = time.monotonic()
        t_fault = case.drive(self, ids)
        p, d = self.p, self.d
        if case.victim:
            (p if case.victim == "P" else d).proc.join(10)
        p_alive, d_alive = p.proc.is_alive(), d.proc.is_alive()
        living = {side: proc for side, proc in (("P", p), ("D", d)) if proc.proc.is_alive()}
        freed = self.watch_freed(living, t_fault, t_fault + bound)
        outcome = self.outcome(d, ids.drid, bound + 5) if d_alive else "dead"
        sp = p.stats() if p_alive else {}
        sd = d.stats() if d_alive else {}
        write = _write_kind(base_p, sp) if p_alive else "P died"
        notes = {k: sp.get(k, 0) - base_p.get(k, 0) for k in NOTE_STATS if p_alive}
        notes.update({f"D.{k}": sd.get(k, 0) - base_d.get(k, 0) for k in NOTE_STATS if d_alive})
        errors = sum(s.get("writer_errors", 0) for s in (sp, sd))
        writers_alive = all(s.get("writer_alive", True) for s in (sp, sd))
        for proc, alive in ((p, p_alive), (d, d_alive)):
            if alive:
                self.arm(proc, [])
        if not p_alive:
            self.replace("P")
        if not d_alive:
            self.replace("D")
        survivor_ok = self.push_and_check(ids)
        got = "D died" if outcome == "dead" else NAMES.get(outcome, outcome)
        victim_ok = (not p_alive) == (case.victim == "P") and (not d_alive) == (case.victim == "D")
        freed_ok = all(v is not None and v <= bound for v in freed.values())
        write_ok = case.expect_write == "any" or write == case.expect_write or not p_alive
        ok = (
            got in case.expect.split("|")
            and victim_ok
            and freed_ok
            and write_ok
            and survivor_ok
            and errors == 0
            and writers_alive
        )
        if not ok:  # start the next case from a fresh pair, whatever state this one left
            self.replace("P")
            self.replace("D")
        return {
            "case": case.name,
            "point": case.point,
            "fault": case.fault,
            "victim": case.victim or "-",
            "expected": case.expect,
            "outcome": got,
            "expected_write": case.expect_write,
            "write": write,
            "freed_s": freed,
            "bound_s": round(bound, 2),
            "survivor_ok": survivor_ok,
            "writer_errors": errors,
            "notes": {k: v for k, v in notes.items() if v},
            "seconds": round(time.monotonic() - t0, 2),
            "ok": ok,
        }


def _write_kind(before: dict[str, Any], after: dict[str, Any]) -> str:
    def delta(k: str) -> int:
        return int(after.get(k, 0)) - int(before.get(k, 0))

    if delta("writes_done"):
        return "done"
    if delta("write_failed"):
        return "failed"
    return "none" if not delta("writes") else "posted"


def run_matrix(
    cases: list[Case],
    opts: MatrixOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``cases`` on one Matrix; a case that raises is recorded as not ok."""
    t0 = time.monotonic()
    m = Matrix(opts)
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            try:
                row = m.run(case)
            except Exception as e:  # record and carry on with a fresh pair
                row = {"case": case.name, "point": case.point, "fault": case.fault, "ok": False}
                row["error"] = f"{type(e).__name__}: {e}"
                for side in ("P", "D"):
                    m.replace(side)
            rows.append(row)
            if progress is not None:
                progress(f"{row['case']}: {'ok' if row['ok'] else 'FAILED'}")
    finally:
        m.close()
    return {
        "cases": len(rows),
        "passed": sum(r["ok"] for r in rows),
        "failed": [r["case"] for r in rows if not r["ok"]],
        "options": vars(m.opts),
        "seconds": round(time.monotonic() - t0, 1),
        "rows": rows,
    }
