"""P side of the tick: match finished blocks with D's registrations, one leg per D rank.

A matched leg goes to the sender (core/sender.py), which posts it on its peer's route
(a copy or a WRITE) and reports its end; the producer answers D, frees the blocks once
every leg has ended, and handles leases, cancels, withdrawals and heartbeats. Runs on the
ticking thread (the engine's, or the keeper); handshake callbacks only put onto
``deferred_push_inbox``.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush.core import trace, wire
from kvpush.core.errors import HandshakeError, TransportError, worth_logging
from kvpush.core.ids import Key, MatchTable, base_request_id
from kvpush.core.layout import as_ids
from kvpush.core.pairing import Pairing, prompt_mismatch, same_prompt
from kvpush.core.records import DKey, Flight, PendingGroup, PendingReg, PRequest, PushTransfer
from kvpush.core.routing import p_targets
from kvpush.core.sender import Sender
from kvpush.core.types import ENDED, Poll, StagedBlocks, State, entered, transition

if TYPE_CHECKING:
    from kvpush.core.peers import Peer
    from kvpush.core.shared import Shared

log = logging.getLogger(__name__)

GONE_CANCELLED, GONE_WITHDRAWN, GONE_EVICTED = "cancelled", "withdrawn", "evicted"


class Producer:
    """Each request is a ``PRequest`` and each of its legs a ``PushTransfer``, in their
    own states (records.py); the tables below are indexes for lookups."""

    def __init__(self, shared: Shared) -> None:
        self.s = shared
        # (transfer or None for a prefetch, host, port, handshake future)
        self.deferred_push_inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.by_prid: dict[str, PRequest] = {}  # every request not ended
        self.staged: MatchTable[PRequest] = MatchTable()  # the STAGED ones, by D's keys
        self.by_dkey: dict[DKey, PushTransfer] = {}  # legs not ended, by D's request
        self.pending_regs: MatchTable[PendingGroup] = MatchTable()  # before P's blocks
        # What P still answers for once it keeps no record, until when: registrations D
        # cancelled (GONE_CANCELLED, D agent, D request id: a late copy is ignored), transfer
        # ids D withdrew before P staged them (GONE_WITHDRAWN, tid) and requests evicted
        # before their blocks came (GONE_EVICTED, P request id): freed as they come.
        self.gone: dict[tuple[str, ...], float] = {}
        # Notices for a D whose handshake still runs, by its address.
        self.outbox: dict[tuple[str, int], list[wire.Message]] = defaultdict(list)
        s = shared
        self.sender = Sender(s.peers, s.stats, s.observe, self._replay, self._finish, self._fail)
        self.pairing = Pairing(s, self.staged, self.pending_regs, self._send_to)

    def has_unmatched(self) -> bool:
        return len(self.staged) > 0

    # ---- inboxes -------------------------------------------------------------------------

    def on_finished(self, staged: StagedBlocks) -> None:
        self.pairing.staging(staged)
        if self.gone.pop((GONE_EVICTED, staged.request_id), None) is not None:
            log.warning(
                "request %s staged after its eviction; its blocks are freed", staged.request_id
            )
            return
        if staged.request_id in self.by_prid:
            log.warning("request %s staged twice; ignoring the second", staged.request_id)
            return
        if self._withdrawn_before(staged):
            self.s.stats["withdrawn"] += 1
            self.s.emit("sent", staged.request_id)  # D will never ask for it
            return
        self.pairing.adopt_named(staged)
        # The common case first: D's registration of this transfer id came first and its
        # copy is armed: copy now, keep the books after (the copy runs meanwhile).
        first = self.pending_regs.by_tid(staged.transfer_id)
        layered = staged.feed is not None  # its blocks are still being written
        # (a registration of another prompt is refused by _attach: nothing launched for it)
        hold = layered or not same_prompt(staged.prompt, first)
        early = None if first is None or hold else self.sender.launch_armed(staged, first)
        key = Key(staged.request_id, staged.transfer_id)
        group = self.pending_regs.pop(key)  # ``first`` if there was one
        if group is None:
            if staged.transfer_id is not None and self.staged.find(key) is not None:
                tid, rid = key.transfer_id, key.request_id
                log.warning("transfer id %s staged twice; ignoring %s", tid, rid)
                return
        elif first is None and not layered and same_prompt(staged.prompt, group):
            early = self.sender.launch_armed(staged, group)  # matched by request id
        preq = PRequest(staged.request_id, staged.block_ids, staged.transfer_id)
        preq.after, preq.feed, preq.prompt = staged.after, staged.feed, staged.prompt
        preq.stats = self.s.stats
        self.by_prid[preq.prid] = preq
        entered(preq, preq.name)
        for pend in group.regs.values() if group else ():
            self._attach(preq, pend, early)
        if preq.state is State.STAGED:
            self.staged.add(key, preq)

    def _withdrawn_before(self, staged: StagedBlocks) -> bool:
        """D withdrew this request's transfer (by its key or by its name) before it came."""
        names = {base_request_id(staged.request_id), staged.transfer_id or ""}
        return any([self.gone.pop((GONE_WITHDRAWN, n), None) is not None for n in names])

    def on_evict(self, prid: str) -> None:
        preq = self.by_prid.get(prid)
        if preq is None:
            self.gone[(GONE_EVICTED, prid)] = math.inf  # (its blocks come within steps)
            self.s.emit("sent", prid)  # nothing of ours holds it
            return
        if preq.state is not State.EVICTING:
            transition(preq, State.EVICTING, preq.name, "lease ran out, aborted or withdrawn")
        self.staged.pop_value(preq)
        for leg in list(preq.legs.values()):
            # A WRITE in flight ends by its outcome; its source blocks stay held until then.
            polled = leg.poll()
            if polled is Poll.TRANSFERRING:
                self._disconnect_silent(leg)
            elif polled is Poll.WAITING:
                transition(leg, State.EXPIRED, leg.name, "lease expired")
                if leg.reg is not None:
                    self.s.stats["lease_expired"] += 1
                self._fail_to_d(leg, "lease expired on the prefiller")
                self._finish(leg)
        self._maybe_done(preq)

    def _disconnect_silent(self, t: PushTransfer) -> None:
        """The lease ran out under a posted WRITE and D has been silent all along: a
        partition looks like a dead D, but the WRITE would go on once the link is back.
        Disconnecting D ends it in error (then its blocks are freed as for any failed
        WRITE) and the next push to D handshakes afresh."""
        peer, f = self.s.peers.by_agent.get(t.sender), t.flight
        stops = f is not None and f.route.stopped_by_forget  # a copy runs to its end
        if stops and peer is not None and self.s.peers.silent(peer):
            log.warning("push %s: D %s silent for the whole lease; disconnecting", t.name, t.sender)
            self.s.peers.forget(t.sender)

    def on_deferred(self, item: tuple[PushTransfer | None, str, int, Future[Any]]) -> None:
        t, host, port, fut = item
        try:
            peer = self.s.peers.load(host, port, fut)
        except (HandshakeError, TransportError) as e:
            # Only a push that waited on it fails with it (push_failures); one made to send
            # D notices is counted apart (after a cut link it fails at once, again and again).
            kind = "handshake_failed" if t is not None else "notice_handshake_failed"
            self.s.stats[kind] += 1
            dropped = self.outbox.pop((host, port), [])
            if worth_logging(n := self.s.stats[kind]):
                why = f"{e} ({len(dropped)} notices dropped, #{n})"
                log.warning("push_handshake_failed %s:%d: %s", host, port, why)
            if t is not None and t.state not in ENDED:
                transition(t, State.FAILED, t.name, "handshake with D failed")
                self._finish(t)
            return
        for msg in self.outbox.pop((host, port), []):
            self.s.notify(peer.agent, msg)
        if t is not None:
            self.sender.push(t)

    # ---- notifications from D ------------------------------------------------------------

    def on_push_reg(self, sender: str, reg: wire.PushReg) -> None:
        if trace.ON:
            trace.mark("p_producer.reg", reg.transfer_id, reg.request_id)
        dkey = (sender, reg.request_id)
        key = Key(reg.request_id, reg.transfer_id)
        if (GONE_CANCELLED, *dkey) in self.gone:
            self.s.stats["reg_after_cancel"] += 1
            log.warning("registration %s from %s arrived after its cancel; ignored", key, sender)
            return
        if not self.pairing.admit(sender, reg):
            return
        group = self.pending_regs.find(key)
        rank = reg.decode_tp_rank
        if dkey in self.by_dkey or (group is not None and rank in group.regs):
            self.s.stats["reg_duplicate"] += 1
            log.warning("duplicate registration %s from %s ignored", key, sender)
            return
        preq = self.pairing.staged_for(key)  # else it waits: refused first if it cannot
        if preq is None and (self.pairing.refuse_ended(key, reg) or not self.pairing.room_for(reg)):
            return
        # The decoder checked the ids for duplicates; D's layout checks the range at WRITE.
        pend = PendingReg(reg, sender, time.monotonic(), [as_ids(g) for g in reg.local_block_ids])
        if preq is not None:
            self._attach(preq, pend)
            if preq.state is not State.STAGED:
                self.staged.pop_value(preq)
            return
        if group is None:
            self.pending_regs.add(key, PendingGroup({rank: pend}))
        else:
            group.regs[rank] = pend
        peer = self.s.peers.get(reg.decode_host, reg.decode_port)
        if peer is not None and peer.agent == sender and self._feeds(reg):
            pend.armed = self.sender.arm(peer, reg, pend.dst)  # while P's blocks are not ready
        # Handshake with D now, so the WRITE can start the moment P's blocks are ready.
        self._prefetch(reg.decode_host, reg.decode_port)

    def on_cancel(self, sender: str, msg: wire.PushCancel) -> None:
        until = time.monotonic() + self.s.config.registration_ttl_s
        self.gone[(GONE_CANCELLED, sender, msg.request_id)] = until
        dkey = (sender, msg.request_id)
        if msg.withdrawn:
            self._withdraw(msg.transfer_id)
            return
        ack = wire.PushFail(
            request_id=msg.request_id,
            reason="cancelled",
            transfer_id=msg.transfer_id,
            tp_rank=self.s.config.tp_rank,
        )
        key = Key(msg.request_id, msg.transfer_id)
        group = self.pending_regs.find(key)
        mine = [r for r, p in (group.regs.items() if group else ()) if p.sender == sender]
        if group is not None and mine:
            pend = group.regs.pop(mine[0])
            if not group.regs:
                self.pending_regs.pop_value(group)
            self._send_to(pend.reg, ack)
            return
        t = self.by_dkey.get(dkey)
        if t is None:
            if sender in self.s.peers.by_agent:  # nothing of ours can touch its blocks
                self.s.notify(sender, ack)
            return
        if t.poll() is Poll.TRANSFERRING:  # the WRITE's completion or failure answers D
            if t.state is State.WRITING:
                transition(t, State.CANCELLING, t.name, "D cancelled")
            return
        transition(t, State.CANCELLED, t.name, "D cancelled")
        assert t.reg is not None
        self._send_to(t.reg, ack)
        self._finish(t)

    def _withdraw(self, tid: str | None) -> None:
        """D will never register transfer ``tid``: free what we keep for it now, or as soon
        as its blocks come (the prompt may still be computing here)."""
        if trace.ON:
            trace.mark("p_producer.withdrawn", tid)
        if tid is None:
            return  # matched by request id alone: leave it to the lease
        preq = self.staged.by_tid(tid) or self.staged.find_named(tid)
        if preq is None:
            self.gone[(GONE_WITHDRAWN, tid)] = time.monotonic() + self.s.config.registration_ttl_s
        elif not preq.legs:  # no other D rank registered: nothing can be writing
            self.s.stats["withdrawn"] += 1
            self.on_evict(preq.prid)

    def on_heartbeat(self, sender: str, hb: wire.Heartbeat) -> None:
        for e in hb.entries:
            leg = self.by_dkey.get((sender, e.request_id))
            key = Key(e.request_id, e.transfer_id)
            preq = leg.preq if leg is not None else self.pairing.staged_for(key)
            if preq is not None:
                self.s.emit("renewed", preq.prid)

    # ---- timers --------------------------------------------------------------------------

    def on_timer(self, now: float) -> None:
        ttl = self.s.config.registration_ttl_s
        for key, group in self.pending_regs.items():
            for rank, pend in list(group.regs.items()):
                if now - pend.arrived <= ttl:
                    continue
                del group.regs[rank]
                self.s.stats["reg_expired"] += 1
                log.warning("registration %s waited %.0fs for prefill blocks; failing it", key, ttl)
                self._send_to(pend.reg, self._fail_msg(pend.reg, "no prefill blocks in time"))
            if not group.regs:
                self.pending_regs.pop_value(group)
        self.pairing.refuse_unknown(now)
        self.pairing.recount()
        self.gone = {k: until for k, until in self.gone.items() if until >= now}
        self.pairing.forget(now)
        held: dict[str, list[wire.HbEntry]] = defaultdict(list)
        for group in self.pending_regs.values():
            for pend in group.regs.values():
                held[pend.sender].append(wire.HbEntry(pend.reg.request_id, pend.reg.transfer_id))
        for (sender, d_rid), t in self.by_dkey.items():
            held[sender].append(wire.HbEntry(d_rid, t.tid))
        for sender, entries in held.items():
            if sender in self.s.peers.by_agent:
                self.s.notify(sender, wire.Heartbeat(entries=entries))

    # ---- matching and writing ------------------------------------------------------------

    def _attach(self, preq: PRequest, pend: PendingReg, early: Flight | None = None) -> None:
        """Start the leg of one D rank's registration: WRITE if this rank feeds that D rank."""
        reg = pend.reg
        if preq.expected is None:
            preq.expected = reg.decode_tp_size
        if reg.decode_tp_size != preq.expected or reg.decode_tp_rank in preq.legs:
            self.s.stats["reg_invalid"] += 1
            self._send_to(reg, self._fail_msg(reg, "inconsistent or repeated D rank"))
            return
        leg = PushTransfer(preq.prid, preq.blocks, preq.tid, preq=preq, stats=self.s.stats)
        leg.reg, leg.sender, leg.dst, leg.armed = reg, pend.sender, pend.dst, pend.armed
        if early is not None and pend.armed is None:
            leg.flight = early
        preq.legs[reg.decode_tp_rank] = leg
        self.by_dkey[(pend.sender, reg.request_id)] = leg
        entered(leg, leg.name)
        if len(preq.legs) == preq.expected and preq.state is State.STAGED:
            transition(preq, State.MATCHED, preq.name, f"{preq.expected} D rank(s)")
        why = prompt_mismatch(preq.prompt, reg)
        if why:  # D computed another prompt: its decode over our KV would be wrong
            self.s.stats["prompt_mismatch"] += 1
            log.warning("push %s refused: %s", leg.name, why)
            transition(leg, State.FAILED, leg.name, why)
            self._send_to(reg, self._fail_msg(reg, why, wire.CAUSE_PROMPT_MISMATCH))
            self._finish(leg)
        elif self._feeds(reg):
            self.sender.push(leg)
        else:  # another P rank holds what this D rank needs
            transition(leg, State.DONE, leg.name, "nothing of this rank for that D rank")
            self._finish(leg)

    # ---- endings -------------------------------------------------------------------------

    def _fail(self, t: PushTransfer, peer: Peer | None, reason: str) -> None:
        log.warning("push %s failed: %s", t.name, reason)
        transition(t, State.FAILED, t.name, reason)
        if t.reg is not None:
            msg = self._fail_msg(t.reg, reason)
            if peer is not None and self.s.peers.by_agent.get(peer.agent) is peer:
                self.s.notify(peer.agent, msg)
            else:  # forgotten (a post found its connection broken): over a fresh handshake,
                self._send_to(t.reg, msg)  # so D fails the request now, not at its watchdog
        self._finish(t)

    def _fail_to_d(self, t: PushTransfer, reason: str) -> None:
        if t.reg is not None:
            self._send_to(t.reg, self._fail_msg(t.reg, reason))

    def _fail_msg(
        self, reg: wire.PushReg, reason: str, cause: str | msgspec.UnsetType = msgspec.UNSET
    ) -> wire.PushFail:
        return wire.PushFail(
            request_id=reg.request_id,
            reason=reason,
            transfer_id=reg.transfer_id,
            tp_rank=self.s.config.tp_rank,
            cause=cause,
        )

    def _send_to(self, reg: wire.PushReg, msg: wire.Message) -> None:
        """Notify the D of ``reg``, after its handshake if that is still running."""
        peer = self.s.peers.get(reg.decode_host, reg.decode_port)
        if peer is not None:
            self.s.notify(peer.agent, msg)
            return
        self.outbox[(reg.decode_host, reg.decode_port)].append(msg)
        self._prefetch(reg.decode_host, reg.decode_port)

    def _prefetch(self, host: str, port: int) -> None:
        self.s.peers.ensure(host, port, self._replay(None, host, port))

    def _replay(
        self, t: PushTransfer | None, host: str, port: int
    ) -> Callable[[Future[Any]], None]:
        """The handshake callback that brings ``t`` (None: a prefetch) back to the tick."""
        return lambda f: self.deferred_push_inbox.put((t, host, port, f))

    def _feeds(self, reg: wire.PushReg) -> bool:
        """This P rank holds some of what that D rank needs (``routing.p_targets``)."""
        cfg = self.s.config
        targets = p_targets(cfg.tp_rank, cfg.tp_size, reg.decode_tp_size, self.s.layout.attention)
        return reg.decode_tp_rank in targets

    def _finish(self, t: PushTransfer) -> None:
        """End one leg; the request's blocks are freed once every leg has ended."""
        if t.reg is not None:
            self.by_dkey.pop((t.sender, t.reg.request_id), None)
        self.sender.forget(t)
        if t.preq is not None:
            self._maybe_done(t.preq)

    def _maybe_done(self, preq: PRequest) -> None:
        """Free the request's blocks once it waits for no registration and every leg ended."""
        if preq.state is State.STAGED or not preq.ended_legs():
            return
        if self.by_prid.pop(preq.prid, None) is None:
            return
        transition(preq, preq.outcome(), preq.name)
        self.staged.pop_value(preq)
        self.pairing.request_ended(preq)
        self.s.emit("sent", preq.prid)
