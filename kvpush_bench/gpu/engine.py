"""GpuEngine: the stepped engine of kvpush_bench.sim, with its KV cache in torch tensors.

The KV cache is one uint8 tensor of shape (regions, num_blocks, block_bytes) on
``spec.device`` ("cuda:N", or "cpu" to run the same code without a GPU); each
region is a view. P fills a request's blocks with a pattern derived from its
transfer id, on the device; D checks every byte on the device. With
``staging_bytes`` > 0 the worker gets a GpuStaging hook.
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpush.core.scheduler import PushScheduler, SchedulerConfig
from kvpush.core.transport import Transport
from kvpush.core.types import RecvRegistration, WorkerConfig
from kvpush.core.worker import PushWorker
from kvpush.gpu.peer_copy import CudaPeerCopy
from kvpush.gpu.staging import GpuStaging
from kvpush.gpu.tensors import layout_from_tensors
from kvpush_bench.sim.engine import content_key

_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so a bijection mod 2**64


@dataclass
class GpuSpec:
    engine_id: str
    port: int
    device: str = "cuda:0"
    regions: int = 4
    num_blocks: int = 256
    block_bytes: int = 16384  # one block of one region; a multiple of 8
    block_size: int = 16
    scattered: bool = True
    seed: int = 0
    host: str = "127.0.0.1"
    staging_bytes: int = 0  # 0: no staging hook
    staging_backend: str = "auto"
    peer_copy: bool = False  # CudaPeerCopy: one kernel straight into a same-host peer
    min_direct_run: int = 4 << 20
    verify: bool = True
    trace: bool = False  # time the writer's stages (see GpuEngine._trace)
    bind_thread: bool = True  # CUDA: CudaNixlTransport (see kvpush_bench/gpu/transport.py)
    lease_s: float = 30.0
    watchdog_s: float = 30.0
    # P: a prefill first keeps the device busy this long (a model's forward, roughly);
    # eager: its blocks go to the core with an event after their last write
    # (StagedBlocks.after) instead of after a device sync (CUDA only).
    prefill_us: float = 0.0
    eager: bool = False
    worker: dict[str, Any] = field(default_factory=dict)  # extra WorkerConfig fields

    @property
    def kv_bytes(self) -> int:
        return self.regions * self.num_blocks * self.block_bytes


def pattern(key: str, region: int, n_blocks: int, block_bytes: int, device: Any) -> Any:
    """(n_blocks, block_bytes) uint8 on ``device``: distinct 8-byte words per position."""
    import torch

    words = n_blocks * block_bytes // 8
    v = torch.arange(words, dtype=torch.int64, device=device)
    v += region << 40
    v *= _MULT
    v += zlib.crc32(key.encode())
    return v.view(torch.uint8).view(n_blocks, block_bytes)


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class GpuEngine:
    def __init__(
        self,
        spec: GpuSpec,
        transport: Transport,
        memory: Any = None,
        staging_buffer: Any = None,
        **worker_kw: Any,
    ) -> None:
        import torch

        if spec.block_bytes % 8:
            raise ValueError("block_bytes must be a multiple of 8")
        self.spec = spec
        self.device = torch.device(spec.device)
        if memory is None:
            memory = torch.empty(spec.kv_bytes, dtype=torch.uint8, device=self.device)
        self.kv = memory[: spec.kv_bytes].view(spec.regions, spec.num_blocks, spec.block_bytes)
        tensors = [self.kv[r] for r in range(spec.regions)]
        layout = layout_from_tensors(tensors, spec.block_size)
        self.staging: GpuStaging | None = None
        if spec.staging_bytes:
            self.staging = GpuStaging(
                layout,
                tensors,
                spec.staging_bytes,
                min_direct_run=spec.min_direct_run,
                backend=spec.staging_backend,
                buffer=staging_buffer,
            )
        self.free = list(range(spec.num_blocks))
        if spec.scattered:
            random.Random(spec.seed).shuffle(self.free)
        self.sched = PushScheduler(SchedulerConfig(spec.lease_s, spec.watchdog_s))
        self.peer_copy: CudaPeerCopy | None = None
        if spec.peer_copy:
            self.peer_copy = CudaPeerCopy(tensors)
        wcfg = WorkerConfig(engine_id=spec.engine_id, host=spec.host, port=spec.port, **spec.worker)
        self.worker = PushWorker(
            wcfg, transport, layout, staging=self.staging, peer_copy=self.peer_copy, **worker_kw
        )
        self.p_reqs: dict[str, tuple[list[int], bool]] = {}  # blocks, from our free list
        self.d_reqs: dict[str, tuple[list[int], str, bool]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.marks: dict[tuple[str, str], float] = {}
        if spec.trace:
            self._trace()

    def _trace(self) -> None:
        """Wrap a few writer-side methods to time-stamp the stages of each transfer.

        For benchmarks only: P's pickup of the finished blocks and the posting of
        the WRITE, D's completion notification and the moment it reports the KV.
        """
        w, marks = self.worker, self.marks
        prod, cons = w.producer, w.consumer
        on_finished, push, on_completion, emit, poll_lane = (
            prod.on_finished,
            prod._push,
            cons.on_completion,
            w.emit,
            cons.poll_lane,
        )

        def t_on_finished(staged: Any) -> None:
            marks[("pickup", staged.request_id)] = time.monotonic()
            on_finished(staged)

        def t_push(t: Any) -> None:
            marks[("push", t.prid)] = time.monotonic()
            push(t)
            marks[("posted", t.prid)] = time.monotonic()
            for name in ("gather", "gathered", "write", "copied", "notify"):
                if (name, "") in marks:
                    marks[(name, t.prid)] = marks.pop((name, ""))

        def stamp(name: str, fn: Any) -> Any:
            def wrapped(*args: Any) -> Any:
                marks[(name, "")] = time.monotonic()
                return fn(*args)

            return wrapped

        def t_unstage(rid: str, block_ids: Any) -> None:
            marks[("scatter", rid)] = time.monotonic()
            unstage(rid, block_ids)

        def t_on_completion(sender: str, c: Any) -> None:
            marks[("notif", c.request_id)] = time.monotonic()
            on_completion(sender, c)

        polls = [0.0, 0.0]  # D: when the lane was read before the latest read, and then

        def t_poll_lane() -> int:
            polls[0], polls[1] = polls[1], time.monotonic()
            return poll_lane()

        def t_emit(kind: str, rid: str, reason: str = "") -> None:
            if kind == "recv":
                marks[("ready", rid)] = time.monotonic()
                marks[("polled", rid)] = polls[0]  # the last read that did not see it yet
                marks[("seen", rid)] = polls[1]  # the read that saw it
            emit(kind, rid, reason)

        w.transport.write = stamp("write", w.transport.write)  # type: ignore[method-assign]
        if self.peer_copy is not None:  # the direct copy stands where the WRITE would
            launch = stamp("write", self.peer_copy.launch)

            def t_launch(*args: Any) -> Any:
                got = launch(*args)
                marks[("copied", "")] = time.monotonic()  # launched (waited for: copied)
                return got

            self.peer_copy.launch = t_launch  # type: ignore[method-assign,assignment]
            w.transport.send_notif = stamp("notify", w.transport.send_notif)  # type: ignore[method-assign]
        if self.staging is not None:
            plan, unstage = self.staging.plan, self.staging.unstage

            def t_plan(*args: Any) -> Any:
                marks[("gather", "")] = time.monotonic()
                got = plan(*args)
                marks[("gathered", "")] = time.monotonic()
                return got

            self.staging.plan = t_plan  # type: ignore[method-assign,assignment]
            self.staging.unstage = t_unstage  # type: ignore[method-assign,assignment]
        prod.on_finished = t_on_finished  # type: ignore[method-assign]
        prod._push = t_push  # type: ignore[method-assign]
        cons.on_completion = t_on_completion  # type: ignore[method-assign]
        cons.poll_lane = t_poll_lane  # type: ignore[method-assign]
        w.emit = t_emit  # type: ignore[method-assign]

    def _marks(self, rid: str, *names: str) -> dict[str, float]:
        return {n: self.marks.pop((n, rid)) for n in names if (n, rid) in self.marks}

    # ---- requests --------------------------------------------------------------------------

    def _take(self, n: int, blocks: list[int] | None) -> tuple[list[int], bool] | None:
        if blocks is not None:  # the caller owns these (benchmarks)
            return list(blocks), False
        if n > len(self.free):
            return None
        got, self.free = self.free[:n], self.free[n:]
        return got, True

    def _give(self, blocks: list[int], owned: bool) -> None:
        if owned:
            self.free.extend(blocks)

    def _index(self, blocks: list[int]) -> Any:
        import torch

        return torch.tensor(blocks, dtype=torch.int64, device=self.device)

    def prefill(
        self, rid: str, tid: str | None, n_blocks: int, blocks: list[int] | None = None
    ) -> bool:
        """P: write the request's KV on the device, then stage it for the push."""
        took = self._take(n_blocks, blocks)
        if took is None:
            return False
        ids, owned = took
        cuda = self.device.type == "cuda"
        idx, key = self._index(ids), content_key(rid, tid)  # (a blocking copy: before)
        if cuda and self.spec.prefill_us > 0:
            import torch

            khz = torch.cuda.get_device_properties(self.device).clock_rate
            torch.cuda._sleep(int(self.spec.prefill_us * khz / 1000))
        for r in range(self.spec.regions):
            want = pattern(key, r, len(ids), self.spec.block_bytes, idx.device)
            self.kv[r].index_copy_(0, idx, want)
        after = None
        if cuda and self.spec.eager:  # the core orders the push behind the writes above
            import torch

            after = torch.cuda.Event()
            after.record()
        else:
            sync(self.device)  # the KV must be complete before any copy engine reads it
        self.p_reqs[rid] = (ids, owned)
        # A GPU engine keeps block tables as arrays: the core takes them without converting
        # (a Python list of 16k ids costs ~0.5 ms to convert on the GPU host).
        table: Any = np.asarray(ids, dtype=np.int64)
        self.sched.request_finished(rid, [table], tid, after=after)
        self.events.append(("staged", rid, {"t": time.monotonic()}))
        return True

    def register(
        self,
        rid: str,
        tid: str,
        n_blocks: int,
        p_engine: str,
        p_host: str,
        p_port: int,
        blocks: list[int] | None = None,
    ) -> bool:
        """D: allocate (and zero) blocks for a request and register them for P's push."""
        took = self._take(n_blocks, blocks)
        if took is None:
            return False
        ids, owned = took
        self.kv.index_fill_(1, self._index(ids), 0)
        sync(self.device)  # no late zeroing may land on P's bytes
        self.d_reqs[rid] = (ids, content_key(rid, tid), owned)
        self.sched.add_registration(
            RecvRegistration(rid, [ids], p_engine, p_host, p_port, transfer_id=tid)
        )
        self.events.append(("registered", rid, {"t": time.monotonic()}))
        return True

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> None:
        meta = self.sched.build_meta()
        t = time.monotonic()
        self.worker.start_step(meta)
        for s in meta.finished:
            info: dict[str, Any] = {"t": t}
            if s.after is not None:
                # Benchmarks: times start when the prefill's writes end, i.e. when the event
                # first reports done (a spin, P only). "late": it was done at the first look
                # (the step's other work took longer than the prefill): t is then too late.
                info["late"] = s.after.query()
                while not s.after.query():
                    pass
                info["t"] = time.monotonic()
            self.events.append(("pushed", s.request_id, info))
        out = self.sched.update(self.worker.get_finished())
        now = time.monotonic()
        for rid in out.finished_sending:
            self._give(*self.p_reqs.pop(rid))
            marks = self._marks(
                rid, "pickup", "push", "gather", "gathered", "write", "copied", "notify", "posted"
            )
            self.events.append(("sent", rid, {"t": now, **marks}))
        for rid in out.finished_recving:
            blocks, key, owned = self.d_reqs.pop(rid)
            t0 = time.monotonic()
            bad = self.verify(blocks, key) if self.spec.verify else -1
            nbytes = len(blocks) * self.spec.regions * self.spec.block_bytes
            took = time.monotonic() - t0
            info = {"t": now, "bytes": nbytes, "bad_regions": bad, "verify_s": took}
            info.update(self._marks(rid, "notif", "scatter", "polled", "seen", "ready"))
            self._give(blocks, owned)
            self.events.append(("recv", rid, info))
        for rid, reason in out.failed_recving.items():
            self._give(*self._drop(rid))
            self.events.append(("failed", rid, {"t": now, "reason": reason}))
        for rid in out.released:
            self._give(*self._drop(rid))
            self.events.append(("released", rid, {"t": now}))

    def _drop(self, rid: str) -> tuple[list[int], bool]:
        blocks, _, owned = self.d_reqs.pop(rid)
        return blocks, owned

    def verify(self, blocks: list[int], key: str) -> int:
        """Number of regions whose bytes differ from what P wrote (checked on the device)."""
        import torch

        idx = self._index(blocks)
        bad = 0
        for r in range(self.spec.regions):
            want = pattern(key, r, len(blocks), self.spec.block_bytes, idx.device)
            bad += not torch.equal(self.kv[r].index_select(0, idx), want)
        return bad

    def take_events(self) -> list[tuple[str, str, dict[str, Any]]]:
        events, self.events = self.events, []
        return events

    def held_blocks(self) -> int:
        return self.spec.num_blocks - len(self.free)

    def busy(self) -> bool:
        return self.sched.has_pending_push_work()

    def close(self) -> None:
        self.worker.shutdown()
        if self.peer_copy is not None:
            self.peer_copy.close()
