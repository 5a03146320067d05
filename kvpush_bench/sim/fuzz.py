"""Fuzz the wire decoder and the notification handlers of live PushWorkers.

A P and a D SimEngine run over the in-memory transport (``core.memory_transport``),
each behind a FaultTransport that counts WRITE calls. P holds staged blocks under
transfer ids the generator knows; D has receives waiting on P. Hostile
notifications (``fuzz_inputs``) are then delivered into their inboxes under chosen
sender names, in batches, and both engines step until the writers have handled
every one. Whatever arrives, the writers must not crash (``writer_errors`` stays 0,
the threads stay alive) and P must not WRITE: every generated registration that
could match staged blocks is invalid in at least one way.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, KVPushError, WireError
from kvpush.core.handshake import fetch_agent_info
from kvpush.core.memory_transport import Fabric, MemoryTransport
from kvpush.core.worker import make_agent_name
from kvpush_bench.sim.engine import SimEngine, SimSpec
from kvpush_bench.sim.fault_matrix import free_port
from kvpush_bench.sim.faults import FaultTransport
from kvpush_bench.sim.fuzz_inputs import Generator, World

IGNORED_STATS = (
    "reg_duplicate",
    "reg_invalid",
    "reg_wrong_sender",
    "reg_after_cancel",
    "reg_expired",
    "completion_unknown",
    "completion_wrong_sender",
    "fail_unknown",
    "handshake_failed",
    "notice_handshake_failed",
)
BLOCKS = 4  # blocks of every staged request and registration


@dataclass
class FuzzOptions:
    inputs: int = 100_000
    seed: int = 0
    batch: int = 500
    staged: int = 8  # P requests kept staged, each under a transfer id the generator knows
    receiving: int = 8  # D receives kept waiting on P
    timeout_s: float = 30.0  # per batch


class FuzzTarget:
    """P and D engines on one fabric; hostile bytes go straight into their inboxes."""

    def __init__(self, opts: FuzzOptions | None = None) -> None:
        self.opts = opts or FuzzOptions()
        self.fabric = Fabric()
        self.crashes: list[str] = []
        worker = {"heartbeat_interval_s": 0.05, "handshake_timeout_s": 0.5}
        common: dict[str, Any] = dict(
            layers=1, num_blocks=64, block_bytes=256, lease_s=1e6, watchdog_s=1e6, worker=worker
        )
        self.p_spec = SimSpec("fuzzP", free_port(), **common)
        self.d_spec = SimSpec("fuzzD", free_port(), **common)
        self.p_tr = FaultTransport(MemoryTransport(self.fabric, make_agent_name("fuzzP", 0)))
        self.d_tr = FaultTransport(MemoryTransport(self.fabric, make_agent_name("fuzzD", 0)))
        self.p = SimEngine(self.p_spec, self.p_tr, fetch=self._fetch)
        self.d = SimEngine(self.d_spec, self.d_tr, fetch=self._fetch)
        self._n = 0
        self.received: set[str] = set()  # D request ids that completed
        self.staged: dict[str, str] = {}  # P request id -> transfer id
        self.recv: dict[str, str] = {}  # D request id -> transfer id
        self.world = World(
            p_agent=self.p_tr.agent_name,
            d_agent=self.d_tr.agent_name,
            p_port=self.p_spec.port,
            d_port=self.d_spec.port,
            d_blocks=self.d_spec.num_blocks,
            p_blocks_per_request=BLOCKS,
            staged_tids=[f"fz-stg-{i}" for i in range(self.opts.staged)],
            recv_tids=[f"fz-rcv-{i}" for i in range(self.opts.receiving)],
        )
        self._warm_up()
        self.base_writes = self.p_tr.calls["write"] + self.d_tr.calls["write"]

    def _fetch(self, host: str, port: int, *args: Any, **kw: Any) -> Any:
        """Handshakes reach our two side channels only; hostile addresses fail at once."""
        if host != "127.0.0.1" or port not in (self.p_spec.port, self.d_spec.port):
            raise HandshakeError(f"fuzz: {host}:{port} is not a peer")
        return fetch_agent_info(host, port, *args, **kw)

    def _warm_up(self) -> None:
        """One real push, so P and D know each other like peers in service."""
        self.p.prefill("fz-warm-p", "fz-warm", BLOCKS)
        self.d.register("fz-warm-d", "fz-warm", BLOCKS, "fuzzP", "127.0.0.1", self.p_spec.port)
        self._until(lambda: "fz-warm-d" in self.received, "warm-up push")
        self._top_up()

    def _top_up(self) -> None:
        held = set(self.staged.values())
        for tid in self.world.staged_tids:
            if tid not in held:
                self._n += 1
                prid = f"fz-p{self._n}-{tid}"
                if self.p.prefill(prid, tid, BLOCKS):
                    self.staged[prid] = tid
        waiting = set(self.recv.values())
        for tid in self.world.recv_tids:
            if tid not in waiting:
                self._n += 1
                drid = f"fz-d{self._n}-{tid}"
                if self.d.register(drid, tid, BLOCKS, "fuzzP", "127.0.0.1", self.p_spec.port):
                    self.recv[drid] = tid
        self.world.recv_rids = list(self.recv)
        self.world.staged_rids = list(self.staged)

    def step(self) -> None:
        try:
            self.p.step()
            self.d.step()
        except KVPushError as e:  # the keeper thread died
            self.crashes.append(f"step: {e}")
            raise
        for kind, rid, _ in self.p.take_events():
            if kind == "sent":
                self.staged.pop(rid, None)
        for kind, rid, _ in self.d.take_events():
            if kind in ("recv", "failed", "released"):
                self.recv.pop(rid, None)
            if kind == "recv":
                self.received.add(rid)
        self._top_up()

    def _until(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.opts.timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"fuzz: no {what} within {self.opts.timeout_s}s")
            self.step()

    def deliver(self, items: list[tuple[str, str, bytes]]) -> None:
        """Put (target "P"/"D", sender, bytes) into inboxes; return once all are handled."""
        for target, sender, raw in items:
            tr = self.p_tr if target == "P" else self.d_tr
            assert isinstance(tr.inner, MemoryTransport)
            tr.inner.deliver(sender, raw)
        self.drain()

    def drain(self) -> None:
        trs = (self.p_tr, self.d_tr)
        self._until(lambda: all(not t.inner._inbox for t in trs), "drained inbox")  # type: ignore[attr-defined]
        # The tick that took the last batch is over once the writer polls again.
        marks = [(t, t.calls["get_notifs"] + 1) for t in trs]
        self._until(lambda: all(t.calls["get_notifs"] > m for t, m in marks), "writer tick")

    def writes(self) -> int:
        return self.p_tr.calls["write"] + self.d_tr.calls["write"] - self.base_writes

    def write_samples(self) -> list[str]:
        """Completion notifications of the WRITEs the fuzz caused (warm-up excluded)."""
        n = min(self.writes(), 16)
        return [repr(m) for m in list(self.p_tr.write_notifs)[-n:]] if n else []

    def writers_alive(self) -> bool:
        return all(e.worker.keeper_alive() for e in (self.p, self.d))

    def stat(self, key: str) -> int:
        return int(self.p.worker.stats[key] + self.d.worker.stats[key])

    def close(self) -> None:
        self.p.close()
        self.d.close()


def decode_outcome(raw: bytes) -> str:
    """ "accepted", "rejected" (WireError) or "crash: <exception>" for one input."""
    try:
        wire.decode(raw)
    except WireError:
        return "rejected"
    except Exception as e:  # anything but WireError is a decoder bug
        return f"crash: {type(e).__name__}: {e}"
    return "accepted"


def run_fuzz(
    opts: FuzzOptions, progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    t0 = time.monotonic()
    target = FuzzTarget(opts)
    gen = Generator(target.world, random.Random(opts.seed))
    categories: dict[str, int] = {}
    decoder_crashes: list[str] = []
    rejected = done = 0
    try:
        while done < opts.inputs and not target.crashes:
            batch = []
            for _ in range(min(opts.batch, opts.inputs - done)):
                cat, dest, sender, raw = gen.next()
                categories[cat] = categories.get(cat, 0) + 1
                verdict = decode_outcome(raw)
                rejected += verdict == "rejected"
                if verdict.startswith("crash"):
                    decoder_crashes.append(f"{cat}: {verdict} on {raw[:60]!r}")
                batch.append((dest, sender, raw))
            target.deliver(batch)
            done += len(batch)
            if not target.writers_alive():
                target.crashes.append("a keeper thread died")
            if progress is not None:
                progress({"inputs": done, "writes_caused": target.writes()})
        live_rejected = target.stat("rejected")
        writer_errors = target.stat("writer_errors")
        summary: dict[str, Any] = {
            "inputs": done,
            "rejected": rejected,
            "accepted": done - rejected,
            "ignored": sum(target.stat(k) for k in IGNORED_STATS),
            "crashes": len(decoder_crashes) + writer_errors + len(target.crashes),
            "writes_caused": target.writes(),
            "writer_errors": writer_errors,
            "writers_alive": target.writers_alive(),
            "rejected_by_workers": live_rejected,
            "handled": {k: target.stat(k) for k in IGNORED_STATS if target.stat(k)},
            # what hostile input left behind on P (bounded by registration_ttl_s, not count)
            "p_pending_registrations": len(target.p.worker.producer.pending_regs),
            "p_remembered": len(target.p.worker.producer.gone),
            "categories": dict(sorted(categories.items())),
            "registration_breaks": dict(sorted(gen.breaks.items())),
            "crash_samples": (decoder_crashes + target.crashes)[:10],
            "write_samples": target.write_samples(),
            "seed": opts.seed,
            "elapsed_s": round(time.monotonic() - t0, 1),
        }
    finally:
        target.close()
    summary["inputs_per_s"] = round(done / max(summary["elapsed_s"], 1e-9))
    return summary
