"""P side of the writer: match finished blocks with D's registrations and WRITE them.

Owned by the writer thread; the engine thread only puts onto the inboxes.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter, defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvpush.core import trace, wire
from kvpush.core.errors import HandshakeError, LayoutError, PeerGoneError, TransportError
from kvpush.core.ids import Key, MatchTable
from kvpush.core.layout import as_ids
from kvpush.core.peer_copy import CopyDst, Signal, copy_dst, copy_src, single_src
from kvpush.core.routing import build_pair_descs, p_targets
from kvpush.core.transport import WriteState
from kvpush.core.types import ENDED, POLL, Moves, Poll, StagedBlocks, State, transition

if TYPE_CHECKING:
    from kvpush.core.peers import Peer
    from kvpush.core.worker import PushWorker

log = logging.getLogger(__name__)

DKey = tuple[str, str]  # (D agent that registered, D request id)


@dataclass
class Armed:
    """A direct copy prepared when D registered: only P's block ids are missing."""

    agent: str  # the D agent it was prepared for
    dst: CopyDst
    handle: object  # the peer-copy hook's


@dataclass
class Launched:
    """A direct copy already launched; the leg's bookkeeping follows it."""

    armed: Armed
    ids: list[Any]
    nbytes: int
    signalled: bool


@dataclass
class PendingReg:
    reg: wire.PushReg
    sender: str
    arrived: float
    # D's ids as arrays, made on arrival so the WRITE path need not convert them.
    dst: list[np.ndarray] = field(default_factory=list)
    armed: Armed | None = None


@dataclass
class PendingGroup:
    """Registrations of one request from D's ranks that came before P's blocks."""

    regs: dict[int, PendingReg] = field(default_factory=dict)  # by D tp rank


@dataclass
class PRequest:
    """A finished P request: one leg per D rank that registered (every D rank does)."""

    prid: str
    blocks: list[list[int]]
    tid: str | None
    expected: int | None = None  # D's TP size, known from the first registration
    after: Any = None  # StagedBlocks.after until waited for (None: the bytes are final)
    legs: dict[int, PushTransfer] = field(default_factory=dict)
    resolved: int = 0
    ended: bool = False  # evicted: no more legs will be started
    since: float = field(default_factory=time.monotonic)  # handed to the producer

    def waiting(self) -> bool:
        return not self.ended and (self.expected is None or len(self.legs) < self.expected)


@dataclass
class PushTransfer:
    """One leg: a P request on its way into one D rank's registration."""

    # Every legal move (docs/architecture.md, "Transfer states", shows this table).
    MOVES: ClassVar[Moves] = {
        State.STAGED: frozenset({State.MATCHED}),  # _attach: a leg is born matched
        State.MATCHED: frozenset(
            {
                State.WRITING,  # WRITE posted or copy launched
                State.DEFERRED,  # handshake with D still running
                State.DONE,  # this P rank feeds nothing of that D rank
                State.FAILED,  # invalid registration, post or launch failed
                State.EXPIRED,  # lease ran out (also while settling)
                State.CANCELLED,  # PUSH_CANCEL
            }
        ),
        State.DEFERRED: frozenset(
            {
                State.WRITING,
                State.DEFERRED,  # D restarted as a new agent: handshake again
                State.FAILED,
                State.EXPIRED,
                State.CANCELLED,
            }
        ),
        # Neither lease nor cancel ends a WRITE in flight: only its outcome.
        State.WRITING: frozenset({State.DONE, State.FAILED}),
    }

    prid: str
    blocks: list[list[int]]
    tid: str | None
    state: State = State.STAGED
    reg: wire.PushReg | None = None
    dst: list[np.ndarray] = field(default_factory=list)  # reg's ids, as arrays
    sender: str = ""
    handle: Any = None
    armed: Armed | None = None  # the direct copy prepared at registration, if any
    early: Launched | None = None  # launched before this leg existed (_launch_armed)
    copy: object | None = None  # a launched direct copy, until it is over
    notify: bool = False  # the copy writes no lane word: P sends the completion after it
    cancelled: bool = False  # D cancelled while the WRITE was in flight
    rechecked: bool = False  # the decoder's address was handshaken again (restart)
    staged_at: float = field(default_factory=time.monotonic)
    preq: PRequest | None = None
    stats: Counter[str] | None = field(default=None, repr=False)  # counts illegal moves

    @property
    def name(self) -> str:
        return self.tid or self.prid

    def poll(self) -> Poll:
        return POLL[self.state]


class Producer:
    def __init__(self, worker: PushWorker) -> None:
        self.w = worker
        # (transfer or None for a prefetch, host, port, handshake future)
        self.deferred_push_inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.staged: MatchTable[PRequest] = MatchTable()  # requests missing registrations
        self.pending_regs: MatchTable[PendingGroup] = MatchTable()
        self.by_prid: dict[str, PRequest] = {}
        self.by_dkey: dict[DKey, PushTransfer] = {}
        self.writing: dict[int, PushTransfer] = {}  # by id() of the leg
        self.settling: dict[int, PushTransfer] = {}  # WRITEs waiting for their blocks' event
        self.tombstones: dict[DKey, float] = {}  # cancelled registrations, until expiry
        self.evicted_unknown: set[str] = set()  # evicted before their blocks reached us
        self.withdrawn: dict[str, float] = {}  # transfer ids D withdrew before we staged them
        self.outbox: dict[tuple[str, int], list[wire.Message]] = defaultdict(list)

    def has_unmatched(self) -> bool:
        return len(self.staged) > 0

    # ---- inboxes -------------------------------------------------------------------------

    def on_finished(self, staged: StagedBlocks) -> None:
        if staged.request_id in self.evicted_unknown:
            self.evicted_unknown.discard(staged.request_id)
            log.warning(
                "request %s staged after its eviction; its blocks are freed", staged.request_id
            )
            return
        if staged.request_id in self.by_prid:
            log.warning("request %s staged twice; ignoring the second", staged.request_id)
            return
        if self.withdrawn.pop(staged.transfer_id or "", None) is not None:
            self.w.stats["withdrawn"] += 1
            self.w.emit("sent", staged.request_id)  # D will never ask for it
            return
        # The common case first: D's registration of this transfer id came first and its
        # copy is armed: copy now, keep the books after (the copy runs meanwhile).
        first = self.pending_regs.by_tid(staged.transfer_id)
        early = None if first is None else self._launch_armed(staged, first)
        key = Key(staged.request_id, staged.transfer_id)
        group = self.pending_regs.pop(key)  # ``first`` if there was one
        if group is None:
            if staged.transfer_id is not None and self.staged.find(key) is not None:
                tid, rid = key.transfer_id, key.request_id
                log.warning("transfer id %s staged twice; ignoring %s", tid, rid)
                return
        elif first is None:  # matched by request id: the same, a few lookups later
            early = self._launch_armed(staged, group)
        preq = PRequest(staged.request_id, staged.block_ids, staged.transfer_id)
        preq.after = staged.after
        self.by_prid[preq.prid] = preq
        log.debug("transfer %s: staged (P request %s)", preq.tid or preq.prid, preq.prid)
        for pend in group.regs.values() if group else ():
            self._attach(preq, pend, early)
        if preq.prid in self.by_prid and preq.waiting():
            self.staged.add(key, preq)

    def on_evict(self, prid: str) -> None:
        preq = self.by_prid.get(prid)
        if preq is None:
            self.evicted_unknown.add(prid)
            self.w.emit("sent", prid)  # nothing of ours holds it
            return
        preq.ended = True
        self.staged.pop_value(preq)
        for leg in list(preq.legs.values()):
            # A WRITE in flight ends by its outcome; its source blocks stay held until then.
            polled = leg.poll()
            if polled is Poll.TRANSFERRING:
                self._disconnect_silent(leg)
            elif polled is Poll.WAITING:
                transition(leg, State.EXPIRED, leg.name, "lease expired")
                if leg.reg is not None:
                    self.w.stats["lease_expired"] += 1
                self._fail_to_d(leg, "lease expired on the prefiller")
                self._finish(leg)
        self._maybe_done(preq)

    def _disconnect_silent(self, t: PushTransfer) -> None:
        """The lease ran out under a posted WRITE and D has been silent all along: a
        partition looks like a dead D, but the WRITE would go on once the link is back.
        Disconnecting D ends it in error (then its blocks are freed as for any failed
        WRITE) and the next push to D handshakes afresh."""
        peer = self.w.peers.by_agent.get(t.sender)
        if t.copy is None and peer is not None and self.w.peers.silent(peer):
            log.warning("push %s: D %s silent for the whole lease; disconnecting", t.name, t.sender)
            self.w.peers.forget(t.sender)

    def on_deferred(self, item: tuple[PushTransfer | None, str, int, Future[Any]]) -> None:
        t, host, port, fut = item
        try:
            peer = self.w.peers.load(host, port, fut)
        except (HandshakeError, TransportError) as e:
            self.w.stats["handshake_failed"] += 1
            dropped = self.outbox.pop((host, port), [])
            log.warning(
                "push_handshake_failed %s:%d: %s (%d notices dropped)", host, port, e, len(dropped)
            )
            if t is not None and t.state not in ENDED:
                transition(t, State.FAILED, t.name, "handshake with D failed")
                self._finish(t)
            return
        for msg in self.outbox.pop((host, port), []):
            self.w.notify(peer.agent, msg)
        if t is not None:
            self._push(t)

    # ---- notifications from D ------------------------------------------------------------

    def on_push_reg(self, sender: str, reg: wire.PushReg) -> None:
        if trace.ON:
            trace.mark("p_producer.reg", reg.transfer_id, reg.request_id)
        dkey = (sender, reg.request_id)
        key = Key(reg.request_id, reg.transfer_id)
        if dkey in self.tombstones:
            self.w.stats["reg_after_cancel"] += 1
            log.warning("registration %s from %s arrived after its cancel; ignored", key, sender)
            return
        if not self._trusted(sender, reg):
            return
        group = self.pending_regs.find(key)
        rank = reg.decode_tp_rank
        if dkey in self.by_dkey or (group is not None and rank in group.regs):
            self.w.stats["reg_duplicate"] += 1
            log.warning("duplicate registration %s from %s ignored", key, sender)
            return
        # The decoder checked the ids for duplicates; D's layout checks the range at WRITE.
        pend = PendingReg(reg, sender, time.monotonic(), [as_ids(g) for g in reg.local_block_ids])
        preq = self.staged.find(key)
        if preq is not None:
            self._attach(preq, pend)
            if not preq.waiting():
                self.staged.pop_value(preq)
            return
        if group is None:
            self.pending_regs.add(key, PendingGroup({rank: pend}))
        else:
            group.regs[rank] = pend
        pend.armed = self._arm(sender, reg, pend.dst)
        # Handshake with D now, so the WRITE can start the moment P's blocks are ready.
        self._prefetch(reg.decode_host, reg.decode_port)

    def _trusted(self, sender: str, reg: wire.PushReg) -> bool:
        """A registration may only name a decoder on the allowlist; nothing else is contacted."""
        allow = self.w.config.trusted_decoders
        where = f"{reg.decode_host}:{reg.decode_port}"
        if allow is None or where in allow:
            return True
        self.w.stats["reg_untrusted"] += 1
        log.warning(
            "registration %s from %s names untrusted decoder %s; refused",
            reg.request_id,
            sender,
            where,
        )
        if sender in self.w.peers.by_agent:  # a peer we already trust can hear why
            self.w.notify(sender, self._fail_msg(reg, f"decoder {where} is not trusted"))
        return False

    def on_cancel(self, sender: str, msg: wire.PushCancel) -> None:
        dkey = (sender, msg.request_id)
        self.tombstones[dkey] = time.monotonic() + self.w.config.registration_ttl_s
        if msg.withdrawn:
            self._withdraw(msg.transfer_id)
            return
        ack = wire.PushFail(
            request_id=msg.request_id,
            reason="cancelled",
            transfer_id=msg.transfer_id,
            tp_rank=self.w.config.tp_rank,
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
            if sender in self.w.peers.by_agent:  # nothing of ours can touch its blocks
                self.w.notify(sender, ack)
            return
        if t.poll() is Poll.TRANSFERRING:
            t.cancelled = True  # the WRITE's completion or failure answers D
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
        preq = self.staged.by_tid(tid)
        if preq is None:
            self.withdrawn[tid] = time.monotonic() + self.w.config.registration_ttl_s
        elif not preq.legs:  # no other D rank registered: nothing can be writing
            self.w.stats["withdrawn"] += 1
            self.on_evict(preq.prid)

    def on_heartbeat(self, sender: str, hb: wire.Heartbeat) -> None:
        for e in hb.entries:
            leg = self.by_dkey.get((sender, e.request_id))
            key = Key(e.request_id, e.transfer_id)
            preq = leg.preq if leg is not None else self.staged.find(key)
            if preq is not None:
                self.w.emit("renewed", preq.prid)

    # ---- timers --------------------------------------------------------------------------

    def on_timer(self, now: float) -> None:
        ttl = self.w.config.registration_ttl_s
        for key, group in self.pending_regs.items():
            for rank, pend in list(group.regs.items()):
                if now - pend.arrived <= ttl:
                    continue
                del group.regs[rank]
                self.w.stats["reg_expired"] += 1
                log.warning("registration %s waited %.0fs for prefill blocks; failing it", key, ttl)
                self._send_to(pend.reg, self._fail_msg(pend.reg, "no prefill blocks in time"))
            if not group.regs:
                self.pending_regs.pop_value(group)
        self.tombstones = {k: until for k, until in self.tombstones.items() if until >= now}
        self.withdrawn = {k: until for k, until in self.withdrawn.items() if until >= now}
        held: dict[str, list[wire.HbEntry]] = defaultdict(list)
        for group in self.pending_regs.values():
            for pend in group.regs.values():
                held[pend.sender].append(wire.HbEntry(pend.reg.request_id, pend.reg.transfer_id))
        for (sender, d_rid), t in self.by_dkey.items():
            held[sender].append(wire.HbEntry(d_rid, t.tid))
        for sender, entries in held.items():
            if sender in self.w.peers.by_agent:
                self.w.notify(sender, wire.Heartbeat(entries=entries))

    # ---- matching and writing ------------------------------------------------------------

    def _launch_armed(self, staged: StagedBlocks, group: PendingGroup) -> Launched | None:
        """Launch the copy prepared for a request's only registration, before any of the
        bookkeeping ``_attach`` and ``_push`` do; None when any of their checks might not
        pass (they then run in full and decide). ``_arm`` checked the rest (this rank
        feeds that D rank). Kept short: it runs on cold caches at the end of a prefill."""
        regs = group.regs
        if len(regs) != 1:
            return None
        (pend,) = regs.values()
        armed, reg = pend.armed, pend.reg
        if armed is None:
            return None
        peer = self.w.peers.get(reg.decode_host, reg.decode_port)
        if peer is None or peer.agent != armed.agent or peer.copy_declined:
            return None
        try:
            limits, blocks = self.w.limits, staged.block_ids
            if armed.dst.single and len(blocks) == 1 and len(limits) == 1:
                one, nbytes = single_src(limits[0], armed.dst, blocks[0])
                ids = [one]
            else:
                ids, nbytes = copy_src(limits, armed.dst, source_blocks(pend.dst, blocks))
            hook = self.w.peer_copy
            signalled = hook.launch(armed.handle, ids, staged.after)  # type: ignore[union-attr]
        except Exception:  # the full path meets it again and fails the leg with the reason
            return None
        pend.armed = None
        self.w.stats["copy_early"] += 1
        if trace.ON:
            trace.mark("p_producer.launch", staged.transfer_id, staged.request_id)
        return Launched(armed, ids, nbytes, signalled)

    def _attach(self, preq: PRequest, pend: PendingReg, early: Launched | None = None) -> None:
        """Start the leg of one D rank's registration: WRITE if this rank feeds that D rank."""
        reg = pend.reg
        if preq.expected is None:
            preq.expected = reg.decode_tp_size
        if reg.decode_tp_size != preq.expected or reg.decode_tp_rank in preq.legs:
            self.w.stats["reg_invalid"] += 1
            self._send_to(reg, self._fail_msg(reg, "inconsistent or repeated D rank"))
            return
        leg = PushTransfer(preq.prid, preq.blocks, preq.tid, preq=preq, stats=self.w.stats)
        leg.reg, leg.sender, leg.dst, leg.armed = reg, pend.sender, pend.dst, pend.armed
        if early is not None and pend.armed is None:
            leg.early = early
        preq.legs[reg.decode_tp_rank] = leg
        self.by_dkey[(pend.sender, reg.request_id)] = leg
        transition(leg, State.MATCHED, leg.name, f"with D request {reg.request_id}")
        cfg = self.w.config
        targets = p_targets(cfg.tp_rank, cfg.tp_size, reg.decode_tp_size, self.w.layout.attention)
        if reg.decode_tp_rank in targets:
            self._push(leg)
        else:  # another P rank holds what this D rank needs
            transition(leg, State.DONE, leg.name, "nothing of this rank for that D rank")
            self._finish(leg)

    def _push(self, t: PushTransfer) -> None:
        if t.state in ENDED:
            log.debug("transfer %s ended (%s) before its WRITE; dropped", t.name, t.state.value)
            return
        reg = t.reg
        assert reg is not None
        if t.early is not None:  # launched by _launch_armed: its peer was checked there
            e, t.early = t.early, None
            known = self.w.peers.by_agent[e.armed.agent]
            self._copied(t, known, e.armed.handle, e.ids, e.nbytes, e.signalled)
            return
        peer = self.w.peers.ensure(
            reg.decode_host,
            reg.decode_port,
            lambda f: self.deferred_push_inbox.put((t, reg.decode_host, reg.decode_port, f)),
        )
        if peer is None:
            transition(t, State.DEFERRED, t.name, "waiting for handshake with D")
            return
        if peer.agent != t.sender:
            if not t.rechecked and t.sender not in self.w.peers.by_agent:
                # The decoder at that address may have restarted as a new agent: ask again.
                t.rechecked = True
                self.w.peers.forget(peer.agent)
                self._push(t)
                return
            self.w.stats["reg_wrong_sender"] += 1
            self._fail(t, peer, f"registration sent by {t.sender}, not by {peer.agent}")
            return
        try:
            src_groups = source_blocks(t.dst, t.blocks)
            armed, t.armed = t.armed, None
            if self._can_copy(peer):
                if armed is None or armed.agent != peer.agent:
                    armed = self._prepare(peer, reg, t.dst)
                if armed is not None:
                    ids, nbytes = copy_src(self.w.limits, armed.dst, src_groups)
                    self._copy(t, peer, armed, ids, nbytes)
                    return
            if not self._settled(t):  # NIXL reads the bytes as they are
                self.settling[id(t)] = t  # check_writes posts it once the event is done
                return
            pairs = self.w.peers.pairs_to(peer)
            src, dst = build_pair_descs(
                self.w.layout, peer.info.layout, pairs, src_groups, t.dst, dst_unique=True
            )
        except (LayoutError, wire.WireError) as e:
            self.w.stats["reg_invalid"] += 1
            self._fail(t, peer, f"invalid registration: {e}")
            return
        notif = wire.encode_completion(reg.request_id, self.w.config.tp_size)
        try:
            t.handle = self.w.transport.write(peer.agent, src, dst, notif)
        except TransportError as e:
            self.w.stats["write_failed"] += 1
            if isinstance(e, PeerGoneError):
                self.w.peers.forget(peer.agent)
            self._fail(t, peer, f"WRITE could not be posted: {e}")
            return
        self.writing[id(t)] = t
        self.w.stats["writes"] += 1
        self.w.stats["write_descs"] += len(src)
        if len(src):
            self.w.stats["write_bytes"] += int(src[:, 1].sum())
        transition(t, State.WRITING, t.name, f"{len(src)} descriptors")

    def _can_copy(self, peer: Peer) -> bool:
        hook = self.w.peer_copy
        return hook is not None and peer.info.peer_copy is not None and not peer.copy_declined

    def _arm(self, sender: str, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """Prepare the direct copy now, while P's blocks are not ready (off the critical
        path); None when D is not connected yet or cannot be copied into."""
        peer = self.w.peers.get(reg.decode_host, reg.decode_port)
        if peer is None or peer.agent != sender or not self._can_copy(peer):
            return None
        cfg, attention = self.w.config, self.w.layout.attention
        if reg.decode_tp_rank not in p_targets(
            cfg.tp_rank, cfg.tp_size, reg.decode_tp_size, attention
        ):
            return None  # this rank writes nothing to that D rank
        try:
            armed = self._prepare(peer, reg, dst)
            self.w.stats["copy_armed"] += armed is not None
            return armed
        except (LayoutError, wire.WireError):
            return None  # the push meets it again and fails the transfer with the reason

    def _prepare(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D's half of a direct copy, checked and handed to the hook; None: WRITE instead.
        Raises LayoutError for ids outside D's layout."""
        hook, exported = self.w.peer_copy, peer.info.peer_copy
        assert hook is not None and exported is not None
        signal = None
        if isinstance(reg.lane, wire.LaneSlot) and peer.info.lane:
            signal = Signal(peer.info.lane, reg.lane.slot, reg.lane.gen)
        cd = copy_dst(self.w.peers.limits_of(peer), self.w.peers.pieces_to(peer), dst, signal)
        try:
            handle = hook.prepare(peer.agent, exported, cd)
        except Exception as e:  # nothing was written: the WRITE still can be
            log.warning("direct copy to %s cannot be prepared (%s); writing instead", peer.agent, e)
            handle = None
        if handle is None:
            # Another host, no mapping, memory D did not export: none of it changes
            # while this peer lives, so later transfers go straight to the WRITE.
            peer.copy_declined = True
            self.w.stats["copy_declined"] += 1
            return None
        return Armed(peer.agent, cd, handle)

    def _copy(self, t: PushTransfer, peer: Peer, armed: Armed, src: list[Any], nbytes: int) -> None:
        """Launch the direct copy; with a lane word D learns of its end from the copy
        itself, otherwise it was waited for and P sends the completion."""
        hook = self.w.peer_copy
        assert hook is not None
        try:
            signalled = hook.launch(armed.handle, src, t.preq.after if t.preq else None)
        except Exception as e:  # could not start, or (waited for) failed
            self.w.stats["copy_failed"] += 1
            self._fail(t, peer, f"direct copy failed: {e}")
            return
        self._copied(t, peer, armed.handle, src, nbytes, signalled)

    @staticmethod
    def _settled(t: PushTransfer) -> bool:
        """True once the device work P's blocks follow (``StagedBlocks.after``) is done:
        asked by query, never waited for (this may be the engine's thread)."""
        preq = t.preq
        if preq is None or preq.after is None:
            return True
        if not preq.after.query():
            return False
        preq.after = None
        return True

    def _copied(
        self,
        t: PushTransfer,
        peer: Peer,
        handle: object,
        src: list[Any],
        nbytes: int,
        signalled: bool,
    ) -> None:
        """A launched copy: polled until over (lane word or stream); then, without a lane
        word, P sends the completion (_notify_copied)."""
        assert t.reg is not None
        self.w.stats["copies"] += 1
        self.w.stats["copy_blocks"] += sum(len(g) for g in src)
        self.w.stats["write_bytes"] += nbytes
        t.copy, t.notify = handle, not signalled
        self.writing[id(t)] = t
        why = "it reports its end to D" if signalled else "P notifies D at its end"
        transition(t, State.WRITING, t.name, f"copy launched; {why}")

    def _notify_copied(self, t: PushTransfer) -> bool:
        """A copy without a lane word is over: tell D (False, and failed, if we cannot)."""
        assert t.reg is not None
        peer = self.w.peers.by_agent.get(t.sender)
        notif = wire.encode_completion(t.reg.request_id, self.w.config.tp_size)
        try:
            if peer is None:
                raise TransportError(f"decoder {t.sender} is gone")
            self.w.transport.send_notif(peer.agent, notif)
        except TransportError as e:
            self.w.stats["write_failed"] += 1
            if isinstance(e, PeerGoneError) and peer is not None:
                self.w.peers.forget(peer.agent)
            self._fail(t, peer, f"completion could not be sent: {e}")
            return False
        return True

    def _observe(self, t: PushTransfer) -> None:
        """push_seconds: from the blocks' hand-over to P seeing the push end."""
        if t.preq is not None:
            self.w.observe("push_seconds", time.monotonic() - t.preq.since)

    def check_writes(self) -> int:
        """Post the WRITEs whose blocks' device work ended; end the WRITEs and launched
        copies that are over. Returns how many changed."""
        changed = 0
        for key, t in list(self.settling.items()):
            if t.state in ENDED or self._settled(t):
                del self.settling[key]
                changed += 1
                self._push(t)  # (drops it if it ended meanwhile)
        for t in list(self.writing.values()):
            state = self._copy_state(t) if t.copy is not None else self._write_state(t)
            if state is WriteState.PENDING:
                continue
            changed += 1
            del self.writing[id(t)]
            what = "copies" if t.copy is not None else "writes"
            t.copy = None
            if state is WriteState.DONE and t.notify and not self._notify_copied(t):
                continue
            if state is WriteState.DONE:
                transition(t, State.DONE, t.name)
                self.w.stats[f"{what}_done"] += 1
                self._observe(t)
                self._finish(t)
            else:
                self.w.stats["write_failed" if what == "writes" else "copy_failed"] += 1
                peer = self.w.peers.by_agent.get(t.sender)
                self._fail(t, peer, "WRITE failed" if what == "writes" else "direct copy failed")
        return changed

    def _write_state(self, t: PushTransfer) -> WriteState:
        try:
            state = self.w.transport.check(t.handle)
        except TransportError as e:
            log.warning("write %s: %s", t.name, e)
            state = WriteState.ERROR
        if state is not WriteState.PENDING:
            self.w.transport.release(t.handle)
            t.handle = None
        return state

    def _copy_state(self, t: PushTransfer) -> WriteState:
        assert self.w.peer_copy is not None
        try:
            return WriteState.DONE if self.w.peer_copy.finished(t.copy) else WriteState.PENDING
        except Exception as e:
            log.warning("direct copy %s: %s", t.name, e)
            return WriteState.ERROR

    # ---- endings -------------------------------------------------------------------------

    def _fail(self, t: PushTransfer, peer: Peer | None, reason: str) -> None:
        log.warning("push %s failed: %s", t.name, reason)
        transition(t, State.FAILED, t.name, reason)
        if peer is not None and t.reg is not None:
            self.w.notify(peer.agent, self._fail_msg(t.reg, reason))
        self._finish(t)

    def _fail_to_d(self, t: PushTransfer, reason: str) -> None:
        if t.reg is not None:
            self._send_to(t.reg, self._fail_msg(t.reg, reason))

    def _fail_msg(self, reg: wire.PushReg, reason: str) -> wire.PushFail:
        return wire.PushFail(
            request_id=reg.request_id,
            reason=reason,
            transfer_id=reg.transfer_id,
            tp_rank=self.w.config.tp_rank,
        )

    def _send_to(self, reg: wire.PushReg, msg: wire.Message) -> None:
        """Notify the D of ``reg``, after its handshake if that is still running."""
        peer = self.w.peers.get(reg.decode_host, reg.decode_port)
        if peer is not None:
            self.w.notify(peer.agent, msg)
            return
        self.outbox[(reg.decode_host, reg.decode_port)].append(msg)
        self._prefetch(reg.decode_host, reg.decode_port)

    def _prefetch(self, host: str, port: int) -> None:
        self.w.peers.ensure(
            host, port, lambda f: self.deferred_push_inbox.put((None, host, port, f))
        )

    def _finish(self, t: PushTransfer) -> None:
        """End one leg; the request's blocks are freed once every leg has ended."""
        if t.reg is not None:
            self.by_dkey.pop((t.sender, t.reg.request_id), None)
        self.writing.pop(id(t), None)
        if t.preq is not None:
            t.preq.resolved += 1
            self._maybe_done(t.preq)

    def _maybe_done(self, preq: PRequest) -> None:
        if preq.resolved < len(preq.legs) or preq.waiting():
            return
        if self.by_prid.pop(preq.prid, None) is None:
            return
        self.staged.pop_value(preq)
        self.w.emit("sent", preq.prid)


def source_blocks(dst: list[np.ndarray], blocks: list[list[int]]) -> list[list[int]]:
    """P's blocks for D's registered ones, per group: D may already hold a prefix (its
    own cache), so P writes the tail."""
    if len(dst) != len(blocks):
        raise LayoutError(f"{len(dst)} block groups, P holds {len(blocks)}")
    src = []
    for g, (d_ids, p_ids) in enumerate(zip(dst, blocks, strict=True)):
        if len(d_ids) > len(p_ids):
            raise LayoutError(f"group {g}: D registered {len(d_ids)} blocks, P holds {len(p_ids)}")
        src.append(p_ids if len(p_ids) == len(d_ids) else p_ids[len(p_ids) - len(d_ids) :])
    return src
