"""A GpuEngine (and the raw NIXL baseline) in a child process, driven over a pipe.

The child owns its device buffers for its whole life (KV memory and staging,
grown on demand) and can be set up again with another GpuSpec (a new agent
over the same memory), so a benchmark pays process start and CUDA init once.
Commands (tuples): ("setup", spec), ("prefill", rid, tid, n, blocks),
("register", rid, tid, n, p_engine, p_host, p_port, blocks), ("stats",), ("pending",),
("profile", "start" | "stop", top), ("tune", sleep_s, switch_s[, spin]),
("raw_open", role, nbytes), ("raw_connect", md), ("raw_write", ...), ("raw_wait", n, timeout),
("raw_fill", ids, block, key, poison), ("raw_verify", ids, block, key), ("ceiling", nbytes,
dst_device, reps), ("stop",). Replies and engine events are (kind, id, dict).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

Event = tuple[str, str, dict[str, Any]]


class _Child:
    def __init__(self, conn: Connection, device: str) -> None:
        import torch

        self.conn = conn
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.buffers: dict[str, Any] = {}
        self.engine: Any = None
        self.raw: Any = None
        self.loop_sleep_s = 0.0
        # Step the engine even while it has no push work (a serving engine under load
        # keeps stepping); False: block on the pipe between requests, as an idle one does.
        self.spin = False
        self.prof: Any = None

    def buffer(self, name: str, nbytes: int) -> Any:
        import torch

        buf = self.buffers.get(name)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(name, None)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.buffers[name] = buf
        return buf

    def setup(self, spec: Any) -> Event:
        from kvpush.core.nixl_transport import NixlTransport
        from kvpush.core.worker import make_agent_name
        from kvpush_bench.gpu.engine import GpuEngine
        from kvpush_bench.gpu.transport import CudaNixlTransport

        self.close_engine()
        mem = self.buffer("kv", spec.kv_bytes)
        staging = self.buffer("staging", spec.staging_bytes) if spec.staging_bytes else None
        name = make_agent_name(spec.engine_id, 0)
        if spec.bind_thread and self.device.type == "cuda":
            transport: NixlTransport = CudaNixlTransport(name, self.device.index or 0)
        else:
            transport = NixlTransport(name)
        self.engine = GpuEngine(spec, transport, memory=mem, staging_buffer=staging)
        backend = self.engine.staging.copier.name if self.engine.staging else None
        if self.engine.peer_copy is not None:
            backend = "ipc"
        info = {"agent": self.engine.worker.info.agent_name, "port": spec.port, "copier": backend}
        return ("ready", spec.engine_id, info)

    def close_engine(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def handle(self, cmd: tuple[Any, ...]) -> Event | None:
        kind, args = cmd[0], cmd[1:]
        e = self.engine
        if kind == "setup":
            return self.setup(args[0])
        if kind == "tune":  # engine-loop sleep, the GIL switch interval, stepping while idle
            self.loop_sleep_s = float(args[0])
            self.spin = bool(args[2]) if len(args) > 2 else False
            if args[1] > 0:
                sys.setswitchinterval(float(args[1]))
            return ("tuned", "", {"switch_s": sys.getswitchinterval()})
        if kind == "prefill":
            return None if e.prefill(*args) else ("nospace", args[0], {})
        if kind == "register":
            return None if e.register(*args) else ("nospace", args[0], {})
        if kind == "pending":  # cheap: polled while a benchmark waits for a registration
            return ("pending", e.spec.engine_id, {"n": len(e.worker.producer.pending_regs)})
        if kind == "stats":
            stats = {"held_blocks": e.held_blocks(), "busy": e.busy(), **e.worker.snapshot()}
            if e.staging is not None:
                stats.update({f"staging_{k}": v for k, v in e.staging.stats.items()})
            if e.peer_copy:
                stats.update({f"peer_copy_{k}": v for k, v in e.peer_copy.stats.items()})
                stats["peer_copy_us"] = e.peer_copy.timing_us()
            return ("stats", e.spec.engine_id, stats)
        if kind == "profile":  # cProfile of this (engine) thread: ("start",) / ("stop", n)
            return self.profile(*args)
        if kind.startswith("raw_") or kind in ("ceiling", "kernels"):
            return getattr(self, kind)(*args)
        return ("error", str(kind), {"reason": f"unknown command {kind!r}"})

    def profile(self, action: str, top: int = 30) -> Event:
        import cProfile
        import io
        import pstats

        if action == "start":
            self.prof = cProfile.Profile()
            self.prof.enable()
            return ("profile", "start", {})
        self.prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(self.prof, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("kvpush|nixl|cupy|numpy", top)
        return ("profile", "stop", {"text": out.getvalue()})

    # ---- raw NIXL baseline -----------------------------------------------------------------

    def raw_open(self, role: str, nbytes: int) -> Event:
        from kvpush_bench.gpu.raw import RawEndpoint

        self.close_engine()
        if self.raw is not None:
            self.raw.close()
        self.raw = RawEndpoint(role, self.buffer("kv", nbytes)[:nbytes])
        return ("raw", "open", self.raw.info())

    def raw_connect(self, metadata: bytes) -> Event:
        return ("raw", "connect", {"peer": self.raw.connect(metadata)})

    def raw_fill(self, ids: list[int], block: int, key: str, poison: bool) -> Event:
        from kvpush_bench.gpu.engine import pattern, sync

        view = self.buffers["kv"][: self.raw.nbytes].view(-1, block)
        idx = _index(ids, self.device)
        if poison:
            view.index_fill_(0, idx, 0)
        else:
            view.index_copy_(0, idx, pattern(key, 0, len(ids), block, self.device))
        sync(self.device)
        return ("raw", "filled", {})

    def raw_verify(self, ids: list[int], block: int, key: str) -> Event:
        import torch

        from kvpush_bench.gpu.engine import pattern

        view = self.buffers["kv"][: self.raw.nbytes].view(-1, block)
        got = view.index_select(0, _index(ids, self.device))
        ok = torch.equal(got, pattern(key, 0, len(ids), block, self.device))
        return ("raw", "verified", {"ok": bool(ok)})

    def raw_write(self, peer: str, writes: list[tuple[Any, ...]]) -> Event:
        out = [self.raw.write(peer, *w) for w in writes]
        return ("raw", "written", {"writes": out})

    def raw_wait(self, n: int, timeout_s: float) -> Event:
        got = self.raw.wait_notifs(n, timeout_s)
        return ("raw", "notifs", {"notifs": got})

    def ceiling(self, nbytes: int, dst_device: str, reps: int) -> Event:
        """Contiguous device copy of ``nbytes`` (into ``dst_device``): median GiB/s."""
        import torch

        src = self.buffer("kv", nbytes)[:nbytes]
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
        times = []
        for i in range(reps + 1):
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize(src.device)
            torch.cuda.synchronize(dst.device)
            if i:
                times.append(time.perf_counter() - t0)
        del dst
        return ("ceiling", dst_device, {"gib_s": nbytes / statistics.median(times) / (1 << 30)})

    def kernels(self, nbytes: int, block: int, reps: int) -> Event:
        """GiB/s of the copy backends alone: gather / scatter of permuted blocks, back to back."""
        import numpy as np
        import torch

        from kvpush.gpu.copy import make_copier

        src = self.buffer("kv", nbytes)[:nbytes]
        dst = self.buffer("staging", nbytes)[:nbytes]
        n = nbytes // block
        perm = np.random.default_rng(0).permutation(n).astype(np.int64)
        scattered = src.data_ptr() + perm * block
        packed = dst.data_ptr() + np.arange(n, dtype=np.int64) * block
        lens = np.full(n, block, dtype=np.int64)
        out: dict[str, Any] = {}
        for backend in ("cupy", "torch"):
            try:
                copier = make_copier([src, dst], backend)
            except Exception as e:
                out[backend] = repr(e)
                continue
            for name, (a, b) in {
                "gather": (scattered, packed),
                "scatter": (packed, scattered),
            }.items():
                t0 = time.perf_counter()
                prep = copier.prepare(a, b, lens)
                out[f"{backend}-{name}-prepare_ms"] = (time.perf_counter() - t0) * 1e3
                times = []
                for i in range(reps + 3):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    copier.launch(prep)
                    e1.record()
                    e1.synchronize()
                    if i >= 3:
                        times.append(e0.elapsed_time(e1) / 1e3)
                out[f"{backend}-{name}-gib_s"] = nbytes / statistics.median(times) / (1 << 30)
        out.update(self._wall_gather(scattered, packed, lens, src, dst))
        return ("kernels", "", out)

    def _wall_gather(self, a: Any, b: Any, lens: Any, src: Any, dst: Any) -> dict[str, float]:
        """Wall ms of prepare + launch + synchronize, as the staging hook does it: right after
        other GPU work, after 20 ms of idle, and from another thread (as the writer)."""
        import threading

        import torch

        from kvpush.gpu.copy import make_copier

        copier = make_copier([src, dst], "cupy")
        stream = torch.cuda.Stream(self.device)

        def once() -> float:
            t0 = time.perf_counter()
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                copier.launch(copier.prepare(a, b, lens))
            stream.synchronize()
            return (time.perf_counter() - t0) * 1e3

        res: dict[str, float] = {}
        for label, idle in (("wall-hot_ms", 0.0), ("wall-idle20ms_ms", 0.02)):
            runs = []
            for _ in range(8):
                time.sleep(idle)
                runs.append(once())
            res[label] = statistics.median(runs[2:])
        got: list[float] = []
        th = threading.Thread(target=lambda: got.extend(once() for _ in range(8)))
        th.start()
        th.join()
        res["wall-thread_ms"] = statistics.median(got[2:])
        return res


def _index(ids: list[int], device: Any) -> Any:
    import torch

    return torch.tensor(ids, dtype=torch.int64, device=device)


def _serve(
    conn: Connection, device: str, log_level: str, loop_sleep_s: float, switch_s: float
) -> None:
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s {device} %(threadName)s %(name)s %(message)s"
    )
    if switch_s > 0:
        sys.setswitchinterval(switch_s)  # the writer thread gets the GIL soon after it asks
    child = _Child(conn, device)
    child.loop_sleep_s = loop_sleep_s
    conn.send(("up", device, {"pid": os.getpid()}))
    try:
        next_look = 0.0
        while True:
            busy = child.engine is not None and child.engine.busy()
            stepping = busy or child.spin
            # While stepping, look at the pipe every 0.5 ms (a poll builds a selector each
            # time: tens of us a step, which no serving engine's loop pays).
            now = time.monotonic()
            look = not stepping or now >= next_look
            if look:
                next_look = now + 5e-4
            if look and conn.poll(0 if stepping else 0.01):
                cmd = conn.recv()
                if cmd[0] == "stop":
                    return
                try:
                    reply = child.handle(cmd)
                except Exception as ex:
                    tb = traceback.format_exc()
                    reply = ("error", str(cmd[0]), {"reason": repr(ex), "tb": tb})
                if reply is not None:
                    conn.send(reply)
            if child.engine is not None:
                child.engine.step()
                for ev in child.engine.take_events():
                    conn.send(ev)
                # Sleep between busy steps; even sleep(0) lasts ~50 us (timer slack) but
                # hands the GIL to a writer thread. An inline worker has none: no sleep.
                inline = child.engine.worker.inline
                if busy and (child.loop_sleep_s > 0 or not inline):
                    time.sleep(child.loop_sleep_s)
    finally:
        child.close_engine()
        if child.raw is not None:
            child.raw.close()
        conn.send(("stopped", device, {}))


class GpuProcess:
    """Parent-side handle of one child: send commands, wait for events, stop or kill."""

    def __init__(
        self,
        device: str,
        log_level: str = "WARNING",
        loop_sleep_s: float = 2e-4,
        switch_s: float = 0.0,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve,
            args=(child, device, log_level, loop_sleep_s, switch_s),
            name=f"kvpush-gpu-{device}",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.device = device
        self.events: list[Event] = []
        self.wait_for(lambda e: e[0] == "up", 120, "start")

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def pump(self, timeout: float = 0.0) -> None:
        try:
            while self.conn.poll(timeout):
                self.events.append(self.conn.recv())
                timeout = 0
        except (EOFError, OSError):
            pass

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, what: str = "event") -> Event:
        """The first event (oldest first) matching ``pred``, removed from ``events``."""
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev[0] == "error":
                    raise RuntimeError(f"{self.device}: {ev[2].get('tb') or ev[2]}")
                if pred(ev):
                    del self.events[i]
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.device}: no {what} within {timeout}s")
            if not self.proc.is_alive() and not self.conn.poll():
                raise RuntimeError(f"{self.device} child exited ({self.proc.exitcode})")
            self.pump(min(left, 0.05))

    def call(self, *cmd: Any, timeout: float = 120.0) -> dict[str, Any]:
        """Send a command and wait for its reply (a non-engine event of kind ``reply_kind``)."""
        self.send(*cmd)
        kinds = {"setup": "ready", "stats": "stats", "ceiling": "ceiling", "tune": "tuned"}
        kinds["profile"] = "profile"
        kinds["pending"] = "pending"
        kinds["kernels"] = "kernels"
        want = kinds.get(cmd[0], "raw")
        return self.wait_for(lambda e: e[0] == want, timeout, str(cmd[0]))[2]

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
            except OSError:
                pass
            self.proc.join(timeout)
        if self.proc.is_alive() and self.proc.pid is not None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)
