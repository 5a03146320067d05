"""Main-thread cost of the connector's per-step calls, with 0, 100 and 1,000 requests in flight.

Times what ``KVPushConnector`` runs on the engine's threads every step, in vLLM's order:
``build_connector_meta`` (scheduler: ``SchedulerSide.build_meta``, no new requests),
``start_load_kv`` (worker: ``PushWorker.start_step``), ``wait_for_save`` (the early
hand-over, nothing to hand over in these steps), ``get_finished`` (``collect``, i.e.
``get_finished`` plus the split into finished/failed/released),
``build_connector_worker_meta``, ``get_kv_connector_stats``, ``update_connector_output``
(``SchedulerSide.update``) and ``has_pending_push_work``. The scheduler and worker
objects are the connector's own (``kvpush.vllm.scheduler_side`` / ``worker_side``) over a
real NIXL agent, with its keeper thread running as in an engine.

In flight on P: finished prefills whose blocks wait for D's registration (held under a
lease, staged on the writer). In flight on D: registrations sent to a live P (a bare
worker in another process that never gets the prefills), waiting for the WRITE; P's
heartbeats renew them once a second, so one step in a second carries N renewals.
Steps are 1 ms apart, as vLLM's loop sleeps between steps while KV is awaited. Every
other step is timed whole (``total``: two clock reads), the others call by call.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvpush_bench.stats import summary

Log = Callable[[str], None]
CALLS = (
    "build_connector_meta",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
    "update_connector_output",
    "has_pending_push_work",
)
BLOCKS = 4096
BLOCK_BYTES = 1024


@dataclass
class FakeRequest:
    """The attributes of vLLM's ``Request`` the connector's scheduler side reads."""

    request_id: str
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    prompt_token_ids: list[int] = field(default_factory=list)
    status: str = "FINISHED_LENGTH_CAPPED"


def _layout(buf: np.ndarray) -> Any:
    from kvpush.core.layout import KVLayout, Region

    half = BLOCKS * BLOCK_BYTES
    regions = [
        Region(f"layer{i}", buf.ctypes.data + i * half, BLOCK_BYTES, BLOCKS) for i in range(2)
    ]
    return KVLayout(regions, block_size=128)


def _worker(engine_id: str, port: int, buf: np.ndarray) -> Any:
    from kvpush.core.nixl_transport import NixlTransport
    from kvpush.core.types import WorkerConfig
    from kvpush.core.worker import PushWorker, make_agent_name

    cfg = WorkerConfig(engine_id=engine_id, port=port)
    return PushWorker(cfg, NixlTransport(make_agent_name(engine_id, 0)), _layout(buf))


def _peer(conn: Connection, port: int) -> None:
    """A bare P worker: answers handshakes, holds D's registrations, sends heartbeats."""
    buf = np.zeros(2 * BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    worker = _worker("peer-p", port, buf)
    conn.send("ready")
    while not conn.poll(0.01):
        worker.get_finished()  # an engine with pending push work steps
    worker.shutdown()


class Role:
    """One engine's connector halves: scheduler side and worker side, stepped like vLLM."""

    def __init__(self, role: str, port: int, peer_port: int) -> None:
        from kvpush.vllm.config import ConnectorOptions
        from kvpush.vllm.scheduler_side import SchedulerSide
        from kvpush.vllm.worker_side import WorkerSide

        self.role = role
        self.peer_port = peer_port
        opts = ConnectorOptions(side_channel_port=port)
        self.sched = SchedulerSide(role, opts, role == "p", role == "d", 1)
        self.wside = WorkerSide(role, opts, 0, 1)
        self.buf = np.zeros(2 * BLOCKS * BLOCK_BYTES, dtype=np.uint8)
        self.wside.worker = _worker(role, port, self.buf)
        self.n = 0

    def add(self, count: int) -> None:
        for _ in range(count):
            i = self.n
            self.n += 1
            blocks = [(2 * i) % (BLOCKS - 2) + 1, (2 * i) % (BLOCKS - 2) + 2]
            if self.role == "p":
                req = FakeRequest(f"p{i}", {"do_remote_decode": True, "transfer_id": f"t{i}"})
                self.sched.request_finished(req, blocks)
            else:
                params = {
                    "do_remote_prefill": True,
                    "transfer_id": f"t{i}",
                    "remote_host": "127.0.0.1",
                    "remote_port": self.peer_port,
                }
                req = FakeRequest(f"d{i}", params, list(range(200)))
                n_ext, _ = self.sched.get_num_new_matched_tokens(req, 0)
                self.sched.update_state_after_alloc(req, (blocks,), n_ext, 128)

    def step(self, t: dict[str, list[float]], per_call: bool = False) -> None:
        """One engine step, timed whole into ``t["total"]`` or call by call (``per_call``)."""
        clock = time.perf_counter_ns
        if not per_call:
            c0 = clock()
            meta = self.sched.build_meta(None)  # no new requests in these steps
            self.wside.start_step(meta)
            self.wside.hand_over()
            rep = self.wside.collect()
            wmeta = self.wside.take_meta()
            self.wside.stats_delta()
            self.sched.update(rep.finished_sending, rep.finished_recving, wmeta)
            self.sched.sched.has_pending_push_work()
            t["total"].append((clock() - c0) / 1e3)
            return
        c0 = clock()
        meta = self.sched.build_meta(None)
        c1 = clock()
        self.wside.start_step(meta)
        c2 = clock()
        self.wside.hand_over()
        c3 = clock()
        rep = self.wside.collect()
        c4 = clock()
        wmeta = self.wside.take_meta()
        c5 = clock()
        self.wside.stats_delta()
        c6 = clock()
        self.sched.update(rep.finished_sending, rep.finished_recving, wmeta)
        c7 = clock()
        self.sched.sched.has_pending_push_work()
        c8 = clock()
        marks = (c0, c1, c2, c3, c4, c5, c6, c7, c8)
        for name, a, b in zip(CALLS, marks, marks[1:], strict=False):
            t[name].append((b - a) / 1e3)
        p0 = clock()
        pickle.loads(pickle.dumps(meta))
        t["meta_pickle"].append((clock() - p0) / 1e3)

    def in_flight(self) -> int:
        w = self.wside.worker
        assert w is not None
        snap = w.snapshot()
        return int(snap["staged"] if self.role == "p" else snap["receiving"])

    def close(self) -> None:
        self.wside.shutdown()


def measure(role: Role, count: int, steps: int, log: Log) -> dict[str, Any]:
    role.add(count - role.n)
    deadline = time.monotonic() + 60
    t: dict[str, list[float]] = {k: [] for k in (*CALLS, "total", "meta_pickle")}
    while role.in_flight() < count and time.monotonic() < deadline:
        role.step({k: [] for k in t})
        time.sleep(0.001)
    settled = role.in_flight()
    for _ in range(50):  # warm-up steps
        role.step({k: [] for k in t})
        time.sleep(0.001)
    for i in range(2 * steps):  # whole steps and call-by-call steps alternate
        role.step(t, per_call=bool(i % 2))
        time.sleep(0.001)
    out = {k: summary(v, 2) for k, v in t.items()}
    log(
        f"step cost {role.role.upper()} with {count:>4} in flight ({settled} settled): "
        f"total median {out['total']['median']} us, p90 {out['total']['p90']} us"
    )
    return {"in_flight": settled, "calls_us": out}


def run_step_cost(
    counts: tuple[int, ...] = (0, 100, 1000), steps: int = 2000, log: Log = print
) -> dict[str, Any]:
    from kvpush.deploy.servers import free_port

    ctx = mp.get_context("spawn")
    peer_port = free_port()
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child, peer_port), daemon=True)
    peer.start()
    result: dict[str, Any] = {"steps": steps, "roles": {}}
    try:
        if not parent.poll(120):
            raise TimeoutError("step-cost peer did not start")
        parent.recv()
        for name in ("p", "d"):
            role = Role(name, free_port(), peer_port)
            try:
                result["roles"][name] = {str(c): measure(role, c, steps, log) for c in counts}
            finally:
                role.close()
    finally:
        parent.send("stop")
        peer.join(10)
        if peer.is_alive():
            peer.kill()
    for c in counts:
        meds = [r[str(c)]["calls_us"]["total"]["median"] for r in result["roles"].values()]
        result[f"step_us_{c}"] = max(m for m in meds if m is not None)
    return result
