"""The synthetic demo: a P process and a D process push N requests over real NIXL.

Each request gets a random size; half arrive at P first, half at D first. D
verifies every byte it received. The summary reports completions, bytes,
blocks still held, KV-ready latency and throughput.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.deploy.servers import free_ports
from kvpush_bench.sim.engine import SimSpec
from kvpush_bench.sim.process import EngineProcess
from kvpush_bench.sim.ranks import RankShape


@dataclass
class DemoOptions:
    requests: int = 64
    max_blocks: int = 32
    layers: int = 4
    block_bytes: int = 16384
    num_blocks: int = 1024
    window: int = 16  # requests in flight at once
    seed: int = 0
    timeout_s: float = 120.0
    log_level: str = "WARNING"
    p_tp: int = 1
    d_tp: int = 1
    p_pp: int = 1
    mla: bool = False
    packed: bool = False


def _suffix(rng: random.Random) -> str:
    return f"{rng.getrandbits(32):08x}"


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    rng = random.Random(opts.seed)
    p_ranks, d_ranks = start_ranks(opts)
    try:
        for proc in p_ranks + d_ranks:
            proc.wait_ready()
        return _drive(opts, rng, p_ranks, d_ranks)
    finally:
        for proc in p_ranks + d_ranks:
            proc.stop()


P_ENGINE = "demo-P"  # the id every P rank shares, as one vLLM engine's ranks do


def start_ranks(opts: DemoOptions) -> tuple[list[EngineProcess], list[EngineProcess]]:
    """P ranks (PP stage-major; rank r listens on base + r) and D ranks, as processes."""
    common = dict(
        layers=opts.layers, num_blocks=opts.num_blocks, block_bytes=opts.block_bytes, seed=opts.seed
    )
    heads = max(opts.p_tp, opts.d_tp) if not opts.mla else 1
    p_base, d_base = free_ports(opts.p_tp * opts.p_pp), free_ports(opts.d_tp)
    p_ranks = [
        EngineProcess(
            SimSpec(
                f"demo-P-s{s}r{i}",
                p_base + s * opts.p_tp + i,
                **common,  # type: ignore[arg-type]
                shape=RankShape(i, opts.p_tp, s, opts.p_pp, heads, opts.mla, opts.packed),
                engine=P_ENGINE,
            ),
            opts.log_level,
        )
        for s in range(opts.p_pp)
        for i in range(opts.p_tp)
    ]
    d_ranks = [
        EngineProcess(
            SimSpec(
                f"demo-D-r{j}",
                d_base + j,
                **common,  # type: ignore[arg-type]
                shape=RankShape(j, opts.d_tp, 0, 1, heads, opts.mla, opts.packed),
            ),
            opts.log_level,
        )
        for j in range(opts.d_tp)
    ]
    return p_ranks, d_ranks


@dataclass
class _Req:
    prid: str
    p_first: bool
    left: int  # D ranks still to report
    failed: bool = False
    bad: int = 0
    nbytes: int = 0
    t_done: float = 0.0


def _drive(
    opts: DemoOptions, rng: random.Random, ps: list[EngineProcess], ds: list[EngineProcess]
) -> dict[str, Any]:
    todo = list(range(opts.requests))
    inflight: dict[str, _Req] = {}  # by D request id
    staged_t: dict[str, float] = {}
    reg_t: dict[str, float] = {}
    ready_ms: list[float] = []
    completed = failed = bad = 0
    nbytes = 0
    order = {"p_first": 0, "d_first": 0}
    t0 = time.monotonic()
    t_last = t0
    deadline = t0 + opts.timeout_s
    while (todo or inflight) and time.monotonic() < deadline:
        while todo and len(inflight) < opts.window:
            i = todo.pop(0)
            tid = uuid.UUID(int=rng.getrandbits(128)).hex
            prid, drid = f"cmpl-{i}-0-{_suffix(rng)}", f"cmpl-{i}-0-{_suffix(rng)}"
            n = rng.randint(1, opts.max_blocks)
            p_first = i % 2 == 0
            reg = (
                "register",
                drid,
                tid,
                n,
                P_ENGINE,
                "127.0.0.1",
                ps[0].spec.port,
                opts.p_tp,
                opts.p_pp,
            )
            pre = ("prefill", prid, tid, n)
            for legs, cmd in ((ps, pre), (ds, reg)) if p_first else ((ds, reg), (ps, pre)):
                for proc in legs:
                    proc.send(*cmd)
            order["p_first" if p_first else "d_first"] += 1
            inflight[drid] = _Req(prid, p_first, len(ds))
        for proc in ps:
            for kind, rid, info in proc.pump(0.0005):
                if kind == "staged":
                    staged_t[rid] = max(staged_t.get(rid, 0.0), info["t"])
        for proc in ds:
            for kind, rid, info in proc.pump(0.0005):
                if kind == "registered":
                    reg_t[rid] = max(reg_t.get(rid, 0.0), info["t"])
                    continue
                req = inflight.get(rid)
                if req is None or kind not in ("recv", "failed", "nospace"):
                    continue
                req.left -= 1
                req.failed |= kind != "recv"
                if kind == "recv":
                    req.bad += info["bad_regions"]
                    req.nbytes += info["bytes"]
                    req.t_done = max(req.t_done, info["t"])
                if req.left:
                    continue
                del inflight[rid]
                if req.failed:
                    failed += 1
                    continue
                completed += 1
                bad += req.bad > 0
                if not req.bad:
                    nbytes += req.nbytes
                start = max(staged_t.get(req.prid, req.t_done), reg_t.get(rid, req.t_done))
                ready_ms.append((req.t_done - start) * 1e3)
                t_last = max(t_last, req.t_done)
    elapsed = max(t_last - t0, 1e-9)
    held_p, held_d = _settle(ps, ds)
    stats = [proc.stats() for proc in ps]
    return {
        "requests": opts.requests,
        "completed": completed,
        "failed": failed + len(inflight),
        "corrupted": bad,
        "bytes_verified": nbytes,
        "held_blocks_p": held_p,
        "held_blocks_d": held_d,
        "kv_ready_ms_p50": _pct(ready_ms, 50),
        "kv_ready_ms_p99": _pct(ready_ms, 99),
        "gib_per_s": round(nbytes / elapsed / 2**30, 3),
        "writes": sum(st.get("writes", 0) for st in stats),
        "write_descriptors": sum(st.get("write_descs", 0) for st in stats),
        "p_ranks": len(ps),
        "d_ranks": len(ds),
        **order,
    }


def _settle(
    ps: list[EngineProcess], ds: list[EngineProcess], timeout: float = 10.0
) -> tuple[int, int]:
    """Blocks still held once every rank is idle (polled with a deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        held_p = sum(int(proc.stats()["held_blocks"]) for proc in ps)
        held_d = sum(int(proc.stats()["held_blocks"]) for proc in ds)
        if (held_p == 0 and held_d == 0) or time.monotonic() > deadline:
            return held_p, held_d
        time.sleep(0.05)


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3) if values else 0.0


def render(summary: dict[str, Any]) -> str:
    s = summary
    return "\n".join(
        [
            f"kvpush synthetic demo: {s['requests']} requests pushed from {s['p_ranks']} P "
            f"rank(s) into {s['d_ranks']} D rank(s) over NIXL",
            f"  completed        {s['completed']}  "
            f"(failed {s['failed']}, corrupted {s['corrupted']})",
            f"  bytes verified   {s['bytes_verified'] / 2**20:.1f} MiB, every byte checked on D",
            f"  arrival order    P first {s['p_first']}, D first {s['d_first']}",
            f"  KV ready         p50 {s['kv_ready_ms_p50']} ms, p99 {s['kv_ready_ms_p99']} ms",
            f"  throughput       {s['gib_per_s']} GiB/s "
            f"({s['writes']} WRITEs, {s['write_descriptors']} descriptors)",
            f"  blocks held      P {s['held_blocks_p']}, D {s['held_blocks_d']} after the run",
        ]
    )
