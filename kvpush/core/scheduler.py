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

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    lease_s: float = 30.0  # P holds finished blocks this long without news from D
    watchdog_s: float = 30.0  # D waits this long for P's WRITE without a heartbeat

    def __post_init__(self) -> None:
        if not self.lease_s > 0 or not self.watchdog_s > 0:
            raise ConfigError("lease_s and watchdog_s must be > 0")


class PushScheduler:
    """Both roles' scheduler state; one instance per engine. Not thread-safe."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        # P side
        self._leases: dict[str, float] = {}  # request id -> deadline
        self._held: dict[str, int] = {}  # request id -> blocks held for the push
        self._evicting: set[str] = set()
        self._new_finished: list[StagedBlocks] = []
        self._early: set[str] = set()  # handed over at the forward, not finished yet
        self._new_early: list[StagedBlocks] = []
        self._new_confirmed: list[str] = []
        # D side
        self._watchdogs: dict[str, float] = {}
        self._new_regs: list[RecvRegistration] = []
        self._new_cancels: list[str] = []
        self._new_withdrawn: list[RecvRegistration] = []
        self._aborted: set[str] = set()
        self._expired: set[str] = set()
        self._rejected: dict[str, str] = {}
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
    ) -> bool:
        """A prefill finished: hold its blocks for the push. Returns True (free later).

        ``after``: device work the blocks' bytes are final after (``StagedBlocks.after``).
        A request handed over early (``hand_over``) is only confirmed: the worker may now
        report it sent; its blocks stay held, whatever the request ended as."""
        if request_id in self._early:
            self._early.discard(request_id)
            self._new_confirmed.append(request_id)
            return True
        if request_id in self._held:
            log.warning("request %s finished twice; ignoring", request_id)
            return True
        self._hold(request_id, block_ids, now)
        self._new_finished.append(StagedBlocks(request_id, block_ids, transfer_id, after))
        return True

    def _hold(self, request_id: str, block_ids: list[list[int]], now: float | None) -> None:
        now = time.monotonic() if now is None else now
        self._leases[request_id] = now + self.config.lease_s
        self._next_deadline = min(self._next_deadline, now + self.config.lease_s)
        self._held[request_id] = sum(len(g) for g in block_ids)

    def hand_over(
        self,
        request_id: str,
        block_ids: list[list[int]],
        transfer_id: str | None = None,
        now: float | None = None,
    ) -> bool:
        """A prefill ends in the step being scheduled: hold its blocks and let the worker
        push them once the step's writes are queued (``StepMeta.early``).

        The engine must call ``request_finished`` for it later (it confirms); until then
        the worker keeps back its finished_sending, so the blocks are never freed while
        the request still runs. Only for requests that end in that step (P's one-token
        requests): one that ran on could be preempted with its blocks in a push.
        False (nothing done) when the request is already held."""
        if request_id in self._held:
            log.warning("request %s handed over twice; ignoring", request_id)
            return False
        self._hold(request_id, block_ids, now)
        self._new_early.append(StagedBlocks(request_id, block_ids, transfer_id))
        self._early.add(request_id)
        return True

    def handed_over(self, request_id: str) -> bool:
        """True while a request handed over early waits for its ``request_finished``."""
        return request_id in self._early

    # ---- D -------------------------------------------------------------------------------

    def add_registration(self, reg: RecvRegistration, now: float | None = None) -> None:
        """D allocated blocks for a request whose KV P will push."""
        if reg.request_id in self._watchdogs:
            log.warning("request %s registered twice; ignoring", reg.request_id)
            return
        now = time.monotonic() if now is None else now
        self._watchdogs[reg.request_id] = now + self.config.watchdog_s
        self._next_deadline = min(self._next_deadline, now + self.config.watchdog_s)
        self._new_regs.append(reg)

    def reject(self, request_id: str, reason: str) -> None:
        """D cannot register this request (bad parameters): the worker reports it failed."""
        log.warning("request %s cannot be received: %s", request_id, reason)
        self._expired.add(request_id)
        self._rejected[request_id] = reason

    def abort(self, request_id: str) -> bool:
        """D aborts a request. True: keep its blocks until the worker reports ``released``."""
        if request_id in self._aborted:
            return True
        if request_id in self._watchdogs:
            self._new_cancels.append(request_id)
        elif request_id not in self._expired:
            return False
        # Live, or expired with its failure still on the way: it comes back in ``released``,
        # also when its KV or failure was already reported by the worker (see ``update``).
        self._aborted.add(request_id)
        return True

    def withdraw(self, reg: RecvRegistration) -> None:
        """D aborted a request before it registered (``reg`` names no blocks): the worker
        tells P, which then frees the blocks it keeps for it without waiting for its lease."""
        self._new_withdrawn.append(reg)

    # ---- every step ----------------------------------------------------------------------

    def build_meta(self, now: float | None = None) -> StepMeta:
        now = time.monotonic() if now is None else now
        new = self._new_regs or self._new_cancels or self._new_finished or self._rejected
        new = new or self._new_early or self._new_confirmed or self._new_withdrawn
        if not new and now < self._next_deadline:  # most steps: nothing to hand over
            return StepMeta()
        meta = StepMeta(
            registrations=self._new_regs,
            cancels=self._new_cancels,
            finished=self._new_finished,
            rejected=self._rejected,
            early=self._new_early,
            confirmed=self._new_confirmed,
            withdrawn=self._new_withdrawn,
        )
        self._new_regs, self._new_cancels, self._new_finished = [], [], []
        self._new_early, self._new_confirmed, self._new_withdrawn = [], [], []
        self._rejected = {}
        if now < self._next_deadline:  # nothing can have run out: no O(requests) scan
            return meta
        for rid, deadline in list(self._leases.items()):
            if deadline <= now and rid not in self._evicting:
                log.warning("lease of request %s expired; evicting its push", rid)
                self._evicting.add(rid)
                meta.evictions.append(rid)
        for rid, deadline in list(self._watchdogs.items()):
            if deadline <= now:
                log.warning("watchdog of request %s expired", rid)
                del self._watchdogs[rid]
                self._expired.add(rid)
                meta.expired.append(rid)
        self._next_deadline = min(
            min((d for r, d in self._leases.items() if r not in self._evicting), default=math.inf),
            min(self._watchdogs.values(), default=math.inf),
        )
        return meta

    def update(self, out: WorkerOutput, now: float | None = None) -> WorkerOutput:
        """Apply the worker's report; returns it restricted to ids this scheduler tracks."""
        now = time.monotonic() if now is None else now
        kept = WorkerOutput()
        for rid in out.finished_sending:
            if self._held.pop(rid, None) is not None:
                self._leases.pop(rid, None)
                self._evicting.discard(rid)
                kept.finished_sending.add(rid)
        for rid in out.finished_recving:
            if self._watchdogs.pop(rid, None) is not None:
                if rid in self._aborted:  # aborted as its KV landed: hand the blocks back once
                    self._aborted.discard(rid)
                    kept.released.add(rid)
                else:
                    kept.finished_recving.add(rid)
        for rid, reason in out.failed_recving.items():
            if self._watchdogs.pop(rid, None) is not None or rid in self._expired:
                self._expired.discard(rid)
                if rid in self._aborted:
                    self._aborted.discard(rid)
                    kept.released.add(rid)
                else:
                    kept.failed_recving[rid] = reason
        for rid in out.released:
            if rid in self._aborted:
                self._aborted.discard(rid)
                self._watchdogs.pop(rid, None)
                self._expired.discard(rid)
                kept.released.add(rid)
        for rid in out.renewed:
            if rid in self._leases and rid not in self._evicting:
                self._leases[rid] = now + self.config.lease_s
                kept.renewed.add(rid)
            if rid in self._watchdogs:
                self._watchdogs[rid] = now + self.config.watchdog_s
                kept.renewed.add(rid)
        if kept.renewed:  # (renewals move deadlines later, unless a caller's clock went back)
            cfg = self.config
            self._next_deadline = min(self._next_deadline, now + min(cfg.lease_s, cfg.watchdog_s))
        return kept

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while any push state is in flight."""
        return bool(
            self._held
            or self._watchdogs
            or self._aborted
            or self._expired
            or self._new_regs
            or self._new_cancels
            or self._new_finished
            or self._new_early
            or self._new_confirmed
            or self._new_withdrawn
        )

    def held_blocks(self) -> int:
        """Blocks P still holds for pushes."""
        return sum(self._held.values())
