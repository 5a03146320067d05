"""Idle CPU: what a push worker costs with no traffic at all.

A P and a D worker (real NIXL agents, each in its own process, as on two engines) push
one request to connect, then sit idle; each process's CPU time (all threads, user + system, as
the process itself reads it) is measured over the window. The engine does not step while it has no
requests, so nothing but the worker's own threads runs: the writer's idle poll, the
heartbeat timer and the side-channel server. A process with the same imports and no
worker is measured alongside as the floor.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvpush_bench.stats import summary

Log = Callable[[str], None]
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of one process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    # Field 2 (comm) may hold spaces: split after its closing parenthesis.
    rest = raw[raw.rindex(")") + 2 :].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by ``pids`` and all their descendants."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None:
                table[int(entry)] = st
    wanted = set(pids)
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in table.items():
            if ppid in wanted and pid not in wanted:
                wanted.add(pid)
                grew = True
    return sum(table[p][1] for p in wanted if p in table)


def _child(conn: Connection, role: str, port: int, peer_port: int) -> None:
    import numpy as np

    from kvpush.core.layout import KVLayout, Region
    from kvpush.core.nixl_transport import NixlTransport
    from kvpush.core.types import RecvRegistration, StagedBlocks, StepMeta, WorkerConfig
    from kvpush.core.worker import PushWorker, make_agent_name

    if role == "floor":
        conn.send("ready")
        _serve_cpu(conn)
        return
    buf = np.zeros(64 * 65536, dtype=np.uint8)
    layout = KVLayout([Region("kv", buf.ctypes.data, 65536, 64)], block_size=16)
    worker = PushWorker(
        WorkerConfig(engine_id=role, port=port), NixlTransport(make_agent_name(role, 0)), layout
    )
    conn.send("ready")
    conn.recv()  # go: push one request so that both sides are connected
    if role == "d":
        reg = RecvRegistration("warm", [[1, 2]], "p", "127.0.0.1", peer_port, transfer_id="w")
        worker.start_step(StepMeta(registrations=[reg]))
    else:
        worker.start_step(StepMeta(finished=[StagedBlocks("warm", [[3, 4]], "w")]))
    deadline = time.monotonic() + 30
    done = False
    while not done and time.monotonic() < deadline:
        out = worker.get_finished()
        done = bool(out.finished_sending or out.finished_recving or out.failed_recving)
        time.sleep(0.001)
    # A few more steps as an engine makes while its last request ends, then no more.
    for _ in range(5):
        worker.get_finished()
        time.sleep(0.01)
    conn.send("pushed" if done else "push failed")
    _serve_cpu(conn)
    worker.shutdown()


def _serve_cpu(conn: Connection) -> None:
    """Answer "cpu" with this process's CPU seconds (all threads) until anything else."""
    while conn.recv() == "cpu":
        conn.send(time.process_time())


def run_idle_cpu(seconds: float = 10.0, log: Log = print) -> dict[str, Any]:
    """Per process: % of one core used over ``seconds`` of idleness."""
    from kvpush.deploy.servers import free_port

    ctx = mp.get_context("spawn")
    p_port, d_port = free_port(), free_port()
    roles = {"p": (p_port, d_port), "d": (d_port, p_port), "floor": (0, 0)}
    procs: dict[str, tuple[Any, Connection]] = {}
    try:
        for role, (port, peer) in roles.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_child, args=(child, role, port, peer), daemon=True)
            proc.start()
            procs[role] = (proc, parent)
        for _, conn in procs.values():
            if not conn.poll(120):
                raise TimeoutError("idle-cpu worker did not start")
            conn.recv()
        for role in ("p", "d"):
            procs[role][1].send("go")
        pushed = {role: procs[role][1].recv() for role in ("p", "d") if procs[role][1].poll(60)}
        time.sleep(1.0)  # let the last heartbeats and backoffs settle
        before = {role: _cpu(conn) for role, (_, conn) in procs.items()}
        log(f"idle CPU: measuring P and D workers over {seconds:g}s ...")
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        pct = {
            role: round(100.0 * (_cpu(conn) - before[role]) / elapsed, 3)
            for role, (_, conn) in procs.items()
        }
    finally:
        for proc, conn in procs.values():
            try:
                conn.send("stop")
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    workers = [pct["p"], pct["d"]]
    return {
        "seconds": seconds,
        "percent_of_core": {"p_worker": pct["p"], "d_worker": pct["d"], "floor": pct["floor"]},
        "worker": summary(workers, 3),
        "idle_cpu_percent": max(workers),
        "connected": pushed,
    }


def _cpu(conn: Connection) -> float:
    conn.send("cpu")
    if not conn.poll(30):
        raise TimeoutError("idle-cpu worker did not answer")
    return float(conn.recv())
