"""Scheduler-side push state, engine-agnostic: request ids and block ids in, StepMeta out.

P side: blocks of finished prefills are held under a lease, renewed by D's
heartbeats; an expired lease asks the worker to evict, and blocks are freed
only when the worker reports them in ``finished_sending`` (so a WRITE still
reading them is never undercut). D side: registrations are stashed for the
worker and guarded by a watchdog renewed by P's heartbeats; an aborted request
keeps its blocks until the worker reports them ``released``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from kvpush.core.errors import ConfigError
from kvpush.core.types import RecvRegistration, StagedBlocks, StepMeta, WorkerOutput
from kvpush.core.wire import PromptPrint

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    lease_s: float = 30.0  # P holds finished blocks this long without news from D
    watchdog_s: float = 30.0  # D waits this long for P's WRITE without a heartbeat

    def __post_init__(self) -> None:
        if not self.lease_s > 0 or not self.watchdog_s > 0:
            raise ConfigError("lease_s and watchdog_s must be > 0")


@dataclass
class Held:
    """P: a finished prefill's blocks, held for its push until the worker reports them sent."""

    blocks: int
    lease: float  # deadline, renewed by D's heartbeats
    evicting: bool = False  # the lease ran out: the worker was asked to evict
    early: bool = False  # handed over at the forward; the engine has not finished it yet


@dataclass
class Watched:
    """D: a request waiting for its KV, until the worker reports how that ended."""

    deadline: float | None  # the watchdog; None once it expired or the request was rejected
    aborted: bool = False  # aborted: its blocks come back in ``released``
    held: bool = False  # failed, its blocks kept from late WRITEs: they come back in ``released``


class PushScheduler:
    """Both roles' scheduler state, one record per request; one instance per engine.
    Not thread-safe."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._p: dict[str, Held] = {}
        self._d: dict[str, Watched] = {}
        self._out = StepMeta()  # what the next build_meta hands the worker
        # No lease or watchdog runs out before this: build_meta scans only past it.
        self._next_deadline = math.inf

    # ---- P -------------------------------------------------------------------------------

    def request_finished(
        self,
        request_id: str,
        block_ids: list[list[int]],
        transfer_id: str | None = None,
        now: float | None = None,
        after: Any = None,
        prompt: PromptPrint | None = None,
    ) -> bool:
        """A prefill finished: hold its blocks for the push. Returns True (free later).

        ``after``: device work the blocks' bytes are final after (``StagedBlocks.after``);
        ``prompt``: the prompt P computed, for the producer to compare with D's.
        A request handed over early (``hand_over``) is only confirmed: the worker may now
        report it sent; its blocks stay held, whatever the request ended as."""
        held = self._p.get(request_id)
        if held is not None and held.early:
            held.early = False
            self._out.confirmed.append(request_id)
            return True
        if held is not None:
            log.warning("request %s finished twice; ignoring", request_id)
            return True
        self._hold(request_id, block_ids, now, early=False)
        staged = StagedBlocks(request_id, block_ids, transfer_id, after, prompt=prompt)
        self._out.finished.append(staged)
        return True

    def _hold(
        self, request_id: str, block_ids: list[list[int]], now: float | None, early: bool
    ) -> None:
        now = time.monotonic() if now is None else now
        lease = now + self.config.lease_s
        self._p[request_id] = Held(sum(len(g) for g in block_ids), lease, early=early)
        self._next_deadline = min(self._next_deadline, lease)

    def hand_over(
        self,
        request_id: str,
        block_ids: list[list[int]],
        transfer_id: str | None = None,
        now: float | None = None,
        layered: bool = False,
        prompt: PromptPrint | None = None,
    ) -> bool:
        """A prefill ends in the step being scheduled: hold its blocks and let the worker
        push them once the step's writes are queued (``StepMeta.early``).

        The engine must call ``request_finished`` for it later (it confirms); until then
        the worker keeps back its finished_sending, so the blocks are never freed while
        the request still runs. Only for requests that end in that step (P's one-token
        requests): one that ran on could be preempted with its blocks in a push.
        False (nothing done) when the request is already held. ``layered``: its
        prefill starts in this step and is pushed layer by layer (``StepMeta.layered``
        carries it, from this step's chunk on)."""
        if request_id in self._p:
            log.warning("request %s handed over twice; ignoring", request_id)
            return False
        self._hold(request_id, block_ids, now, early=True)
        if not layered:
            self._out.early.append(StagedBlocks(request_id, block_ids, transfer_id, prompt=prompt))
        return True

    def arrived(self, names: list[str]) -> None:
        """Names of a request that came to P's engine (``StepMeta.arrived``): P's workers
        refuse a registration naming none that came (core/pairing.py)."""
        self._out.arrived.extend(names)

    def departed(self, names: list[str]) -> None:
        """Names of a request that left P's engine without being handed over."""
        self._out.departed.extend(names)

    def handed_over(self, request_id: str) -> bool:
        """True while a request handed over early waits for its ``request_finished``."""
        held = self._p.get(request_id)
        return held is not None and held.early

    # ---- D -------------------------------------------------------------------------------

    def add_registration(self, reg: RecvRegistration, now: float | None = None) -> None:
        """D allocated blocks for a request whose KV P will push."""
        watched = self._d.get(reg.request_id)
        if watched is not None and watched.deadline is not None:
            log.warning("request %s registered twice; ignoring", reg.request_id)
            return
        now = time.monotonic() if now is None else now
        deadline = now + self.config.watchdog_s
        if watched is None:
            self._d[reg.request_id] = Watched(deadline)
        else:  # its earlier failure is still on the way: it keeps its abort
            watched.deadline = deadline
        self._next_deadline = min(self._next_deadline, deadline)
        self._out.registrations.append(reg)

    def reject(self, request_id: str, reason: str) -> None:
        """D cannot register this request (bad parameters): the worker reports it failed."""
        log.warning("request %s cannot be received: %s", request_id, reason)
        self._d.setdefault(request_id, Watched(None)).deadline = None
        self._out.rejected[request_id] = reason

    def abort(self, request_id: str) -> bool:
        """D aborts a request. True: keep its blocks until the worker reports ``released``."""
        watched = self._d.get(request_id)
        if watched is None:
            return False
        if watched.aborted:
            return True
        if watched.deadline is not None:
            self._out.cancels.append(request_id)
        # Live, or expired with its failure still on the way: it comes back in ``released``,
        # also when its KV or failure was already reported by the worker (see ``update``).
        watched.aborted = True
        return True

    def withdraw(self, reg: RecvRegistration) -> None:
        """D aborted a request before it registered (``reg`` names no blocks): the worker
        tells P, which then frees the blocks it keeps for it without waiting for its lease."""
        self._out.withdrawn.append(reg)

    # ---- every step ----------------------------------------------------------------------

    def build_meta(self, now: float | None = None) -> StepMeta:
        now = time.monotonic() if now is None else now
        if not self._out and now < self._next_deadline:  # most steps: nothing to hand over
            return StepMeta()
        meta, self._out = self._out, StepMeta()
        if now < self._next_deadline:  # nothing can have run out: no O(requests) scan
            return meta
        soonest = math.inf
        for rid, held in self._p.items():
            if held.evicting:
                continue
            if held.lease <= now:
                log.warning("lease of request %s expired; evicting its push", rid)
                held.evicting = True
                meta.evictions.append(rid)
            else:
                soonest = min(soonest, held.lease)
        for rid, watched in self._d.items():
            if watched.deadline is None:
                continue
            if watched.deadline <= now:
                log.warning("watchdog of request %s expired", rid)
                watched.deadline = None
                meta.expired.append(rid)
            else:
                soonest = min(soonest, watched.deadline)
        self._next_deadline = soonest
        return meta

    def update(self, out: WorkerOutput, now: float | None = None) -> WorkerOutput:
        """Apply the worker's report; returns it restricted to ids this scheduler tracks."""
        now = time.monotonic() if now is None else now
        kept = WorkerOutput()
        for rid in out.finished_sending:
            if self._p.pop(rid, None) is not None:
                kept.finished_sending.add(rid)
        for rid in out.finished_recving:
            watched = self._d.get(rid)
            if watched is not None and watched.deadline is not None:
                del self._d[rid]
                if watched.aborted:  # aborted as its KV landed: hand the blocks back once
                    kept.released.add(rid)
                else:
                    kept.finished_recving.add(rid)
        for rid, reason in out.failed_recving.items():
            watched = self._d.pop(rid, None)
            if watched is not None and rid in out.held:
                # Failed, but a late WRITE may still land: tracked (and the engine kept
                # stepping) until its blocks come back in ``released``.
                watched.deadline, watched.held = None, True
                self._d[rid] = watched
                kept.held[rid] = out.held[rid]
                if not watched.aborted:
                    kept.failed_recving[rid] = reason
            elif watched is not None and watched.aborted:
                kept.released.add(rid)
            elif watched is not None:
                kept.failed_recving[rid] = reason
        for rid in out.released:
            watched = self._d.get(rid)
            if watched is not None and (watched.aborted or watched.held):
                del self._d[rid]
                kept.released.add(rid)
        for rid in out.renewed:
            held, watched = self._p.get(rid), self._d.get(rid)
            if held is not None and not held.evicting:
                held.lease = now + self.config.lease_s
                kept.renewed.add(rid)
            if watched is not None and watched.deadline is not None:
                watched.deadline = now + self.config.watchdog_s
                kept.renewed.add(rid)
        if kept.renewed:  # (renewals move deadlines later, unless a caller's clock went back)
            cfg = self.config
            self._next_deadline = min(self._next_deadline, now + min(cfg.lease_s, cfg.watchdog_s))
        return kept

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while any push state is in flight."""
        return bool(self._p or self._d or self._out)

    def held_blocks(self) -> int:
        """Blocks P still holds for pushes."""
        return sum(held.blocks for held in self._p.values())
