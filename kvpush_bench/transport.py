"""Transport level: kvpush's WRITE path against a raw NIXL WRITE on the same buffers.

Two processes, P and D, each with one 256 MiB buffer (4096 blocks of 64 KiB) registered
with two NIXL agents (UCX, progress thread off): a raw one and kvpush's own (a
``PushWorker`` over ``NixlTransport``). In each round, for each block pattern, three
WRITEs move the same blocks (P's ``src`` ids into D's ``dst`` ids), in rotating order:

- raw: P builds one descriptor per block, posts one WRITE with a notification and
  busy-polls ``check_xfer_state`` until DONE (timed on P from building the descriptors).
- raw_runs: the same with one descriptor per run of blocks contiguous on both sides, the
  blocks taken in P's order (what a careful hand-written NIXL caller would post).
- kvpush: D's worker has registered ``dst`` with P (``PUSH_REG``, not timed); P's engine
  hands its worker the finished blocks (``start_step``), timed until the worker sees the
  WRITE DONE (its ``transport.check``): matching, descriptors (one per contiguous run),
  post. The WRITE is posted and checked on the calling thread, as the raw WRITE is.
  P's and D's engines step as vLLM with kvpush's connector does while a push is pending:
  empty steps back to back for ``IDLE_SPIN_S``, then one every ``IDLE_SLEEP_S``
  (``EngineLoop``; vLLM's own work per step is not included, so this is the connector's
  best case); when P's engine saw ``finished_sending`` is kept too (``kvpush_engine``).

Throughput is 256 MiB over P's time; "ready" is when D learned of it (the raw
notification, or ``finished_recving``), on the same monotonic clock. One WRITE to the
next varies by +-20 % here, so the ratio per pattern is the median over rounds of (the
raw time of the round) / (the kvpush time of the same round); ``write_ratio_vs_raw`` is
the lowest over the patterns (``_raw_runs``: the same against raw_runs). A warm-up round
comes first and an untimed round last, after which D checks every byte. Patterns:
``contiguous`` (ids in order on both sides), ``scattered`` (random permutations on both
sides), ``fragmented`` (runs of 1-15 blocks in random order, cut differently per side).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvpush.core.layout import in_source_order
from kvpush_bench.stats import ratio, summary

Log = Callable[[str], None]
BLOCK = 64 * 1024
MIB = 1 << 20
PATTERNS = ("contiguous", "scattered", "fragmented")
MODES = ("raw", "raw_runs", "kvpush")
KV_MODES = ("kvpush",)
# How kvpush/vllm/worker_side.py paces vLLM's empty steps (the same values; a unit test
# checks they stay equal).
IDLE_SPIN_S = 0.005
IDLE_SLEEP_S = 0.0005


class EngineLoop:
    """The pause between two engine steps while a push is pending, as in vLLM: none for
    the first IDLE_SPIN_S, then IDLE_SLEEP_S each."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def pause(self) -> None:
        if time.monotonic() - self.start >= IDLE_SPIN_S:
            time.sleep(IDLE_SLEEP_S)


def chunked(n: int, rng: random.Random, lo: int = 1, hi: int = 15) -> list[int]:
    """0..n-1 cut into runs of lo..hi ids, the runs in random order."""
    runs, i = [], 0
    while i < n:
        k = rng.randint(lo, hi)
        runs.append(list(range(i, min(n, i + k))))
        i += k
    rng.shuffle(runs)
    return [b for run in runs for b in run]


def block_lists(pattern: str, n: int, seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(f"{pattern}-{seed}")
    if pattern == "contiguous":
        return list(range(n)), list(range(n))
    if pattern == "scattered":
        src, dst = list(range(n)), list(range(n))
        rng.shuffle(src)
        rng.shuffle(dst)
        return src, dst
    return chunked(n, rng), chunked(n, rng)


def runs(src: list[int], dst: list[int]) -> int:
    """Descriptors needed: in P's order (as kvpush takes them), positions where either
    side's next id is not the next block."""
    s, d = in_source_order(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
    if s.size == 0:
        return 0
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


def fill_pattern(buf: np.ndarray) -> None:
    buf.view(np.uint32)[:] = np.arange(buf.size // 4, dtype=np.uint32) * np.uint32(2654435761)


# ---- child process -----------------------------------------------------------------------


class _Side:
    def __init__(
        self, role: str, ports: dict[str, int], nblocks: int, host: str = "127.0.0.1"
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from kvpush.core.layout import KVLayout, Region
        from kvpush.core.nixl_transport import NixlTransport
        from kvpush.core.transport import WriteState
        from kvpush.core.types import WorkerConfig
        from kvpush.core.worker import PushWorker, make_agent_name

        self.role, self.nblocks = role, nblocks
        self.buf = np.zeros(nblocks * BLOCK, dtype=np.uint8)
        if role == "p":
            fill_pattern(self.buf)
        self.base = int(self.buf.ctypes.data)
        self.raw = nixl_agent(
            f"raw{role}-{min(ports.values())}",
            nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
        )
        self.raw.register_memory([(self.base, self.buf.nbytes, 0, "")], "DRAM")
        layout = KVLayout([Region("kv", self.base, BLOCK, nblocks)], block_size=16)
        self.workers: dict[str, PushWorker] = {}
        # When the worker last saw a WRITE end (its transport.check); its last
        # transport.write: start, end.
        self.write_done: dict[str, float] = {}
        self.write_call: dict[str, tuple[float, float]] = {}
        for mode, port in ports.items():  # P: one worker per kvpush mode; D: one
            cfg = WorkerConfig(f"bench-{role}-{mode}", host=host, port=port)
            transport = NixlTransport(make_agent_name(cfg.engine_id, 0))
            self._time(mode, transport, WriteState)
            self.workers[mode] = PushWorker(cfg, transport, layout)
        self.peer = ""
        self.peer_base = 0

    def _time(self, mode: str, transport: Any, pending: Any) -> None:
        check, write = transport.check, transport.write
        self.write_done[mode], self.write_call[mode] = 0.0, (0.0, 0.0)

        def timed_check(handle: object) -> Any:
            state = check(handle)
            if state is not pending.PENDING:
                self.write_done[mode] = time.monotonic()
            return state

        def timed_write(*args: Any) -> object:
            t = time.monotonic()
            try:
                return write(*args)
            finally:
                self.write_call[mode] = (t, time.monotonic())

        transport.check = timed_check
        transport.write = timed_write

    def info(self) -> dict[str, Any]:
        return {"raw_md": bytes(self.raw.get_agent_metadata()), "base": self.base}

    def connect(self, md: bytes, base: int) -> None:
        got = self.raw.add_remote_agent(md)
        self.peer = got.decode() if isinstance(got, bytes) else str(got)
        self.peer_base = base

    def raw_write(self, src: list[int], dst: list[int], merge: bool = False) -> dict[str, Any]:
        """One raw WRITE: a descriptor per block, or per run contiguous on both sides."""

        def rows(addr: np.ndarray, length: np.ndarray) -> np.ndarray:
            return np.stack([addr, length, np.zeros_like(addr)], axis=1)

        t0 = time.monotonic()
        s_ids, d_ids = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        if merge:  # the runs kvpush finds: in P's order
            s_ids, d_ids = in_source_order(s_ids, d_ids)
        s = self.base + s_ids * BLOCK
        d = self.peer_base + d_ids * BLOCK
        length = np.full(s.size, BLOCK, dtype=np.int64)
        if merge:
            first = np.ones(s.size, dtype=bool)
            first[1:] = (s[1:] != s[:-1] + BLOCK) | (d[1:] != d[:-1] + BLOCK)
            starts = np.flatnonzero(first)
            s, d = s[starts], d[starts]
            length = np.diff(np.append(starts, first.size)) * BLOCK
        local = self.raw.get_xfer_descs(rows(s, length), "DRAM")
        remote = self.raw.get_xfer_descs(rows(d, length), "DRAM")
        handle = self.raw.initialize_xfer("WRITE", local, remote, self.peer, b"raw")
        state = self.raw.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = self.raw.check_xfer_state(handle)
        t1 = time.monotonic()
        self.raw.release_xfer_handle(handle)
        return {"t0": t0, "t_done": t1, "ok": state == "DONE", "descs": int(s.size)}

    def raw_wait(self, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.raw.get_new_notifs():
                return {"t_ready": time.monotonic()}
            time.sleep(5e-5)
        return {"t_ready": 0.0}

    @property
    def worker(self) -> Any:  # D's only worker
        return next(iter(self.workers.values()))

    def kv_register(self, rid: str, dst: list[int], p_port: int, p_host: str = "127.0.0.1") -> None:
        from kvpush.core.ids import ANY_ENGINE
        from kvpush.core.types import RecvRegistration, StepMeta

        # P runs one worker (engine id) per mode, each on its own port: name no engine.
        reg = RecvRegistration(rid, [dst], ANY_ENGINE, p_host, p_port, transfer_id=rid)
        self.worker.start_step(StepMeta(registrations=[reg]))

    def kv_wait_registered(self, mode: str, n: int, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.workers[mode].get_finished()
            if self.workers[mode].snapshot()["pending_registrations"] >= n:
                return True
            time.sleep(1e-3)
        return False

    def kv_push(self, mode: str, rid: str, src: list[int], timeout: float = 30.0) -> dict[str, Any]:
        from kvpush.core.types import StagedBlocks, StepMeta

        w = self.workers[mode]
        descs0 = w.stats["write_descs"]
        t0 = time.monotonic()
        w.start_step(StepMeta(finished=[StagedBlocks(rid, [src], rid)]))
        out = self._until(w, rid, "finished_sending", timeout)
        # t_done: the WRITE path's end (the worker saw DONE); t_engine: P's next engine step.
        out["t_engine"], out["t_done"] = out.get("t_done", 0.0), self.write_done[mode]
        out["t_write"], out["t_posted"] = self.write_call[mode]
        return {"t0": t0, **out, "descs": w.stats["write_descs"] - descs0}

    def kv_wait(self, rid: str, timeout: float = 30.0) -> dict[str, Any]:
        return self._until(self.worker, rid, "finished_recving", timeout)

    def _until(self, worker: Any, rid: str, what: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        loop = EngineLoop()
        while time.monotonic() < deadline:
            out = worker.get_finished()
            if rid in getattr(out, what):
                key = "t_done" if what == "finished_sending" else "t_ready"
                return {key: time.monotonic(), "ok": True}
            if out.failed_recving:
                return {"ok": False, "error": str(out.failed_recving)}
            loop.pause()
        return {"ok": False, "error": f"no {what} in {timeout}s"}

    def verify(self, dst: list[int], src: list[int]) -> bool:
        """D: does block dst[i] hold what P's block src[i] holds?"""
        expect = np.zeros_like(self.buf)
        fill_pattern(expect)
        got = self.buf.reshape(self.nblocks, BLOCK)[dst]
        return bool(np.array_equal(got, expect.reshape(self.nblocks, BLOCK)[src]))

    def close(self) -> None:
        for w in self.workers.values():
            w.shutdown()


def _child(
    conn: Connection, role: str, ports: dict[str, int], nblocks: int, host: str = "127.0.0.1"
) -> None:
    import logging

    logging.getLogger("NIXL").setLevel(logging.WARNING)
    side = _Side(role, ports, nblocks, host)
    conn.send(side.info())
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "zero":
            side.buf[:] = 0
            conn.send(None)
        else:
            conn.send(getattr(side, cmd)(*args))
    side.close()


# ---- parent ------------------------------------------------------------------------------


class _Remote:
    def __init__(self, ctx: Any, role: str, ports: dict[str, int], nblocks: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, role, ports, nblocks), daemon=True)
        self.proc.start()
        self.ports = ports

    def call(self, *cmd: Any, timeout: float = 120.0) -> Any:
        self.conn.send(cmd)
        return self.result(timeout)

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def result(self, timeout: float = 120.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"transport bench child gave no answer in {timeout}s")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def run_transport(
    total_mib: int = 256, rounds: int = 7, seed: int = 0, log: Log = print
) -> dict[str, Any]:
    from kvpush.deploy.servers import free_port

    nblocks = total_mib * MIB // BLOCK
    ctx = mp.get_context("spawn")
    p = _Remote(ctx, "p", {m: free_port() for m in KV_MODES}, nblocks)
    d = _Remote(ctx, "d", {"kvpush": free_port()}, nblocks)
    keys = [f"{m}{k}" for m in MODES for k in ("_s", "_ready_s")]
    for m in KV_MODES:
        keys += [f"{m}_engine_s", f"{m}_before_write_s", f"{m}_write_call_s"]
    times: dict[str, dict[str, list[float]]] = {pat: {k: [] for k in keys} for pat in PATTERNS}
    descs: dict[str, dict[str, int]] = {}
    verified: dict[str, bool] = {}
    equal: dict[str, bool] = {}  # every kvpush WRITE posted one descriptor per run
    seq = 0
    try:
        pinfo, dinfo = p.result(), d.result()
        p.call("connect", dinfo["raw_md"], dinfo["base"])
        d.call("connect", pinfo["raw_md"], pinfo["base"])
        log(
            f"transport: {total_mib} MiB in {nblocks} blocks of 64 KiB, {rounds} rounds "
            f"(+1 warm-up) x {len(PATTERNS)} patterns, {', '.join(MODES)} in rotating order"
        )
        for r in range(rounds + 2):  # a warm-up round, the timed rounds, a checking round
            for pat in PATTERNS:
                src, dst = block_lists(pat, nblocks, seed * 1000 + r)
                last = r == rounds + 1
                k = r % len(MODES)
                for mode in ("kvpush",) if last else MODES[k:] + MODES[:k]:
                    seq += 1
                    if mode.startswith("raw"):
                        d.send("raw_wait")
                        w = p.call("raw_write", src, dst, mode == "raw_runs")
                        ready = d.result()
                        descs.setdefault(pat, {})[mode] = int(w["descs"])
                    else:
                        rid = f"x{seq}"
                        if last:
                            d.call("zero")
                        d.call("kv_register", rid, dst, p.ports[mode])
                        if not p.call("kv_wait_registered", mode, 1):
                            raise RuntimeError("P never saw D's registration")
                        d.send("kv_wait", rid)
                        w = p.call("kv_push", mode, rid, src)
                        ready = d.result()
                        if not (w.get("ok") and ready.get("ok")):
                            raise RuntimeError(f"kvpush push failed: {w} {ready}")
                        n_runs = runs(src, dst)
                        descs.setdefault(pat, {}).update({mode: int(w["descs"]), "runs": n_runs})
                        equal[pat] = equal.get(pat, True) and int(w["descs"]) == n_runs
                        if last:
                            verified[pat] = bool(d.call("verify", dst, src))
                    if r == 0 or last:
                        continue  # warm-up (connections, handshakes, page faults), check
                    times[pat][f"{mode}_s"].append(w["t_done"] - w["t0"])
                    if mode in KV_MODES:
                        times[pat][f"{mode}_engine_s"].append(w["t_engine"] - w["t0"])
                        times[pat][f"{mode}_before_write_s"].append(w["t_write"] - w["t0"])
                        times[pat][f"{mode}_write_call_s"].append(w["t_posted"] - w["t_write"])
                    times[pat][f"{mode}_ready_s"].append(ready["t_ready"] - w["t0"])
            if 0 < r <= rounds:
                log(
                    f"transport round {r}/{rounds}: "
                    + ", ".join(
                        f"{pat} raw {_gib(total_mib, times[pat]['raw_s'][-1]):.2f} / "
                        f"{_gib(total_mib, times[pat]['raw_runs_s'][-1]):.2f} / kvpush "
                        f"{_gib(total_mib, times[pat]['kvpush_s'][-1]):.2f} GiB/s"
                        for pat in PATTERNS
                    )
                )
    finally:
        p.stop()
        d.stop()
    return _result(total_mib, times, descs, verified, seed, equal)


def _gib(total_mib: int, seconds: float) -> float:
    return total_mib / 1024 / seconds if seconds > 0 else 0.0


def _result(
    total_mib: int,
    times: dict[str, dict[str, list[float]]],
    descs: dict[str, dict[str, int]],
    verified: dict[str, bool],
    seed: int,
    equal: dict[str, bool],
) -> dict[str, Any]:
    patterns: dict[str, Any] = {}
    for pat, t in times.items():
        row: dict[str, Any] = {}
        for mode in MODES:
            row[f"{mode}_gib_s"] = summary([_gib(total_mib, x) for x in t[f"{mode}_s"]], 3)
            row[f"{mode}_ms"] = summary([x * 1e3 for x in t[f"{mode}_s"]], 3)
            row[f"{mode}_ready_ms"] = summary([x * 1e3 for x in t[f"{mode}_ready_s"]], 3)
        for m in KV_MODES:
            row[f"{m}_engine_gib_s"] = summary([_gib(total_mib, x) for x in t[f"{m}_engine_s"]], 3)
            # Where kvpush's time goes: before the WRITE call (wake, matching, descriptors)
            # and in it (NIXL's prepare and post: the copy itself, over cma, is in the post).
            for k in (f"{m}_before_write", f"{m}_write_call"):
                row[f"{k}_ms"] = summary([x * 1e3 for x in t[f"{k}_s"]], 3)
        row["ratio_of_medians"] = ratio(row["kvpush_gib_s"]["median"], row["raw_gib_s"]["median"])
        # Each round's kvpush time against the raw time measured next to it (robust to the
        # drift of a shared machine): the headline. raw_runs: the stricter comparison.
        for base, kv, key in (
            ("raw", "kvpush", "ratio_vs_raw"),
            ("raw_runs", "kvpush", "ratio_vs_raw_runs"),
        ):
            paired = [r / k for r, k in zip(t[f"{base}_s"], t[f"{kv}_s"], strict=True) if k]
            row[f"paired_{key}"] = summary(paired, 3)
            row[key] = row[f"paired_{key}"]["median"]
        row["descriptors"] = descs.get(pat, {})
        row["verified"] = verified.get(pat, False)
        patterns[pat] = row
    ratios = [r["ratio_vs_raw"] for r in patterns.values() if r["ratio_vs_raw"] is not None]
    strict = [r["ratio_vs_raw_runs"] for r in patterns.values() if r["ratio_vs_raw_runs"]]
    return {
        "total_mib": total_mib,
        "block_bytes": BLOCK,
        "seed": seed,
        "patterns": patterns,
        "write_ratio_vs_raw": min(ratios) if ratios else None,
        "write_ratio_vs_raw_runs": min(strict) if strict else None,
        "descriptors_equal_runs": all(equal.values()) and bool(descs),
    }
