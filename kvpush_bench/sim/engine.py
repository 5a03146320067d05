"""A minimal engine around the core: a block allocator, a KV cache in CPU memory,
the scheduler and the worker, stepped like an LLM engine would step them.

Used by the synthetic demo, the integration tests and the soak. P fills each
request's blocks with bytes derived from its transfer id; D checks every byte.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvpush.core.ids import base_request_id
from kvpush.core.layers import LayerFeed, Piece
from kvpush.core.scheduler import PushScheduler, SchedulerConfig
from kvpush.core.transport import Transport
from kvpush.core.types import RecvRegistration, StagedBlocks, WorkerConfig
from kvpush.core.wire import PromptPrint
from kvpush.core.worker import PushWorker
from kvpush_bench.sim.faults import FaultPlan
from kvpush_bench.sim.ranks import RankMemory, RankShape

log = logging.getLogger(__name__)


@dataclass
class SimSpec:
    engine_id: str
    port: int
    layers: int = 4
    num_blocks: int = 512
    block_bytes: int = 4096  # bytes of one block of one K or V region
    block_size: int = 16  # tokens per block
    scattered: bool = True  # allocate blocks in random order
    seed: int = 0
    host: str = "127.0.0.1"
    lease_s: float = 30.0
    watchdog_s: float = 30.0
    worker: dict[str, Any] = field(default_factory=dict)  # extra WorkerConfig fields
    faults: FaultPlan | None = None  # process.py wraps the transport in a FaultTransport
    shape: RankShape = field(default_factory=RankShape)  # TP / PP rank, MLA, packed rows
    # The engine's id when several ranks make one engine (vLLM gives every rank its
    # engine's id, and P refuses a registration naming another); engine_id labels the rank.
    engine: str | None = None


def content_key(rid: str, tid: str | None) -> str:
    """What P's bytes derive from: the transfer id, else the id both sides share."""
    return tid or base_request_id(rid)


class SimEngine:
    def __init__(self, spec: SimSpec, transport: Transport, **worker_kw: Any) -> None:
        self.spec = spec
        self.mem = RankMemory(
            spec.shape, spec.layers, spec.num_blocks, spec.block_bytes, spec.block_size
        )
        layout = self.mem.layout
        self.free = list(range(spec.num_blocks))
        if spec.scattered:
            random.Random(spec.seed).shuffle(self.free)
        self.sched = PushScheduler(SchedulerConfig(spec.lease_s, spec.watchdog_s))
        wcfg = WorkerConfig(
            engine_id=spec.engine or spec.engine_id,
            host=spec.host,
            port=spec.port,
            tp_rank=spec.shape.tp_rank,
            tp_size=spec.shape.tp_size,
            **spec.worker,
        )
        self.worker = PushWorker(wcfg, transport, layout, **worker_kw)
        self.p_reqs: dict[str, list[int]] = {}
        self.d_reqs: dict[str, tuple[list[int], str]] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self._forward: dict[str, list[Piece]] = {}  # layer-wise prompts' pieces to come
        self._feeds: dict[str, LayerFeed] = {}

    # ---- requests --------------------------------------------------------------------------

    def _alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def _release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def prefill(
        self,
        rid: str,
        tid: str | None,
        n_blocks: int,
        early: bool = False,
        prompt: PromptPrint | None = None,
    ) -> bool:
        """P: 'compute' the KV of a request and stage it for the push (``early``: hand it
        over in the next step, as vLLM's connector does at the forward; ``finish`` then
        ends the request; ``prompt``: the print of the prompt P computed)."""
        blocks = self._alloc(n_blocks)
        if blocks is None:
            return False
        self.mem.fill(content_key(rid, tid), blocks)
        self.p_reqs[rid] = blocks
        if early:
            self.sched.hand_over(rid, [blocks], tid, prompt=prompt)
        else:
            self.sched.request_finished(rid, [blocks], tid, prompt=prompt)
        self.events.append(("staged", rid, {"t": time.monotonic()}))
        return True

    def prefill_layered(self, rid: str, tid: str | None, n_blocks: int, chunks: int = 1) -> bool:
        """P: a prompt pushed layer by layer: handed over now with an empty feed, then
        each step 'writes' one region of one chunk (chunk k's blocks start with the
        block chunk k-1 ended in, as a chunk starting mid-block), the last closes it and
        ends the request."""
        blocks = self._alloc(n_blocks)
        if blocks is None:
            return False
        self.mem.fill(content_key(rid, tid), blocks)
        self.p_reqs[rid] = blocks
        self.sched.hand_over(rid, [blocks], tid, layered=True)
        feed = LayerFeed([n_blocks])
        self.worker.hand_over([StagedBlocks(rid, [blocks], tid, feed=feed)])
        cuts = [n_blocks * k // chunks for k in range(chunks + 1)]
        names = [r.name for r in self.mem.layout.regions]
        starts = [0] + [max(0, a - 1) for a in cuts[1:-1]]  # a chunk starts mid-block
        self._forward[rid] = [
            Piece(name, [blocks[a:b]], [a])
            for a, b in zip(starts, cuts[1:], strict=True)
            for name in names
        ]
        self._feeds[rid] = feed
        self.events.append(("staged", rid, {"t": time.monotonic()}))
        return True

    def _write_layers(self) -> None:
        """One piece of every layer-wise prompt per step, as a forward writes its layers."""
        for rid, pieces in list(self._forward.items()):
            feed = self._feeds[rid]
            if pieces:
                feed.add(pieces.pop(0))
            if not pieces:
                feed.close()
                del self._forward[rid], self._feeds[rid]
                self.finish(rid)

    def finish(self, rid: str) -> None:
        """P: the engine ends a request it handed over early."""
        self.sched.request_finished(rid, [self.p_reqs[rid]])

    def register(
        self,
        rid: str,
        tid: str | None,
        n_blocks: int,
        p_engine: str,
        p_host: str,
        p_port: int,
        p_tp: int = 1,
        p_pp: int = 1,
        prompt: PromptPrint | None = None,
    ) -> bool:
        """D: allocate blocks for a request and register them for P's push (``prompt``:
        the print of the prompt D computed)."""
        blocks = self._alloc(n_blocks)
        if blocks is None:
            return False
        self.mem.zero(blocks)
        self.d_reqs[rid] = (blocks, content_key(rid, tid))
        self.sched.add_registration(
            RecvRegistration(
                rid,
                [blocks],
                p_engine,
                p_host,
                p_port,
                remote_tp_size=p_tp,
                transfer_id=tid,
                remote_pp_size=p_pp,
                prompt=prompt,
            )
        )
        self.events.append(("registered", rid, {"t": time.monotonic()}))
        return True

    def withdraw(self, rid: str, tid: str | None, p_engine: str, p_host: str, p_port: int) -> None:
        """D: the client went away before the request got blocks (so it never registered)."""
        self.sched.withdraw(RecvRegistration(rid, [], p_engine, p_host, p_port, transfer_id=tid))

    def abort(self, rid: str) -> None:
        """D: the client went away."""
        if rid not in self.d_reqs:
            return
        if not self.sched.abort(rid):
            self._release(self.d_reqs.pop(rid)[0])

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> None:
        self._write_layers()
        meta = self.sched.build_meta()
        self.worker.start_step(meta)
        self.worker.hand_over(meta.early)  # as an engine does once the step's writes are queued
        out = self.sched.update(self.worker.get_finished())
        now = time.monotonic()
        for rid in out.finished_sending:
            self._release(self.p_reqs.pop(rid))
            self.events.append(("sent", rid, {"t": now}))
        for rid in out.finished_recving:
            blocks, tid = self.d_reqs.pop(rid)
            bad = self.verify(blocks, tid)
            self._release(blocks)
            nbytes = len(blocks) * self.mem.bytes_per_block
            self.events.append(("recv", rid, {"t": now, "bytes": nbytes, "bad_regions": bad}))
        for rid, reason in out.failed_recving.items():
            if rid not in out.held:  # held: its blocks come back in ``released``
                self._release(self.d_reqs.pop(rid)[0])
            self.events.append(("failed", rid, {"t": now, "reason": reason}))
        for rid in out.released:
            self._release(self.d_reqs.pop(rid)[0])
            self.events.append(("released", rid, {"t": now}))

    def verify(self, blocks: list[int], key: str) -> int:
        """Number of head pages (layer, K/V, head, block) that differ from what P wrote."""
        return self.mem.verify(key, blocks)

    def take_events(self) -> list[tuple[str, str, dict[str, Any]]]:
        events, self.events = self.events, []
        return events

    def held_blocks(self) -> int:
        return self.spec.num_blocks - len(self.free)

    def busy(self) -> bool:
        return self.sched.has_pending_push_work() or bool(self._forward)

    def close(self) -> None:
        self.worker.shutdown()
