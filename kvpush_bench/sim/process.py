"""Run a SimEngine with a real NIXL agent in its own process, driven over a pipe.

The parent sends commands; the child steps its engine like an engine loop and
sends every event back. Used by the demo, integration tests and the soak.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvpush_bench.sim.engine import SimEngine, SimSpec
from kvpush_bench.sim.faults import FaultInjector, FaultTransport

Event = tuple[str, str, dict[str, Any]]

BUSY_POLL_S = 2e-4  # engine-loop period while push work is pending
IDLE_POLL_S = 0.02


def _serve(conn: Connection, spec: SimSpec, log_level: str) -> None:
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s {spec.engine_id} %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("NIXL").setLevel(max(logging.WARNING, logging.getLogger().level))
    from kvpush.core.handshake import fetch_agent_info
    from kvpush.core.nixl_transport import NixlTransport
    from kvpush.core.transport import Transport
    from kvpush.core.worker import make_agent_name

    transport: Transport = NixlTransport(make_agent_name(spec.engine_id, 0))
    kw: dict[str, Any] = {}
    if spec.faults is not None:  # armed at start or later by a "faults" command
        injector = FaultInjector(spec.faults)
        transport = FaultTransport(transport, injector)
        kw["fetch"] = injector.wrap_fetch(fetch_agent_info)
    engine = SimEngine(spec, transport, **kw)
    conn.send(("ready", spec.engine_id, {"agent": engine.worker.info.agent_name}))
    try:
        while True:
            # One command per step, as an engine admits work between steps.
            if conn.poll(BUSY_POLL_S if engine.busy() else IDLE_POLL_S):
                cmd = conn.recv()
                if cmd[0] == "stop":
                    return
                _handle(engine, conn, cmd)
            engine.step()
            for ev in engine.take_events():
                conn.send(ev)
    finally:
        engine.close()
        conn.send(("stopped", spec.engine_id, {}))


def _handle(engine: SimEngine, conn: Connection, cmd: tuple[Any, ...]) -> None:
    kind = cmd[0]
    if kind == "prefill":
        if not engine.prefill(*cmd[1:]):
            conn.send(("nospace", cmd[1], {}))
    elif kind == "prefill_layered":
        if not engine.prefill_layered(*cmd[1:]):
            conn.send(("nospace", cmd[1], {}))
    elif kind == "register":
        if not engine.register(*cmd[1:]):
            conn.send(("nospace", cmd[1], {}))
    elif kind == "abort":
        engine.abort(cmd[1])
    elif kind == "faults":
        tr = engine.worker.transport
        if isinstance(tr, FaultTransport):
            tr.injector.set_plan(cmd[1])
        else:
            conn.send(("error", "faults", {"reason": "started without SimSpec.faults"}))
    elif kind == "stats":
        tr = engine.worker.transport
        faults = dict(tr.injector.fired) if isinstance(tr, FaultTransport) else {}
        conn.send(
            (
                "stats",
                engine.spec.engine_id,
                {
                    "held_blocks": engine.held_blocks(),
                    "busy": engine.busy(),
                    "writer_alive": engine.worker.keeper_alive(),
                    "faults": faults,
                    **engine.worker.snapshot(),
                },
            )
        )
    else:
        conn.send(("error", str(kind), {"reason": f"unknown command {kind!r}"}))


class EngineProcess:
    """Parent-side handle: start, command, collect events, kill."""

    def __init__(self, spec: SimSpec, log_level: str = "WARNING") -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(child, spec, log_level),
            name=f"kvpush-{spec.engine_id}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.events: list[Event] = []
        self.agent = ""

    def wait_ready(self, timeout: float = 180.0) -> None:
        ev = self.wait_for(lambda e: e[0] == "ready", timeout, "ready")
        self.agent = ev[2]["agent"]

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def pump(self, timeout: float = 0.0) -> list[Event]:
        """Receive whatever events arrived (waiting up to ``timeout`` for the first)."""
        got: list[Event] = []
        try:
            while self.conn.poll(timeout if not got else 0):
                got.append(self.conn.recv())
        except (EOFError, OSError):
            pass
        self.events.extend(got)
        return got

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, what: str = "event") -> Event:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for ev in self.events[seen:]:
                if pred(ev):
                    return ev
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.spec.engine_id}: no {what} within {timeout}s")
            if not self.proc.is_alive() and not self.conn.poll():
                raise RuntimeError(f"{self.spec.engine_id} exited ({self.proc.exitcode})")
            self.pump(min(left, 0.05))

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        mark = len(self.events)
        self.send("stats")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events[mark:]:
                if ev[0] == "stats":
                    self.events.remove(ev)
                    return ev[2]
            self.pump(0.05)
        raise TimeoutError(f"{self.spec.engine_id}: no stats within {timeout}s")

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
            except OSError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
