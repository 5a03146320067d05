"""D side of the tick: send registrations to P and account for completions.

Registrations and cancels share one inbox so a cancel is always handled after
the registration it cancels. Completions come from one place (``_completion``): NIXL
notifications, and the ends of same-host copies the copy route's receiver saw.
Runs on the ticking thread (the engine's, or the keeper).
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush.core import trace, wire
from kvpush.core.copy_route import CopyReceiver
from kvpush.core.errors import HandshakeError, LayoutError, TransportError
from kvpush.core.late_writes import kernel_hold_s
from kvpush.core.layout import validate_block_ids
from kvpush.core.records import RecvTransfer
from kvpush.core.routing import d_sources
from kvpush.core.types import RecvRegistration, State, entered, transition

if TYPE_CHECKING:
    from kvpush.core.shared import Shared

log = logging.getLogger(__name__)

# A receive failed by a PUSH_FAIL of a known cause counts under it, not "recv_failed".
_FAILED_BY = {wire.CAUSE_PROMPT_MISMATCH: "recv_prompt_mismatch"}


class Consumer:
    def __init__(self, shared: Shared, copies: CopyReceiver | None = None) -> None:
        self.s = shared
        # Same-host P ranks' copies into us (none: every completion comes over NIXL).
        self.copies = copies or CopyReceiver(0, "", Counter())
        # ("reg", RecvRegistration, None | (port, handshake future)) | ("cancel", id, expired)
        # | ("withdraw", RecvRegistration, None | (port, handshake future))
        self.reg_send_inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self.recvs: dict[str, RecvTransfer] = {}
        self._block_bytes: list[int] | None = None  # bytes of one logical block, per group
        hold = shared.config.late_write_hold_s
        self.hold_s = kernel_hold_s() if hold is None else hold
        # Failed receives whose blocks we keep: id -> (until, sources that may still write).
        self.holds: dict[str, tuple[float, set[str]]] = {}

    def outstanding(self) -> int:
        return len(self.recvs)

    def only_copies(self) -> bool:
        """Every outstanding receive ends by its sources' copies (no notification awaited)."""
        return len(self.recvs) == self.copies.covered()

    # ---- inbox -----------------------------------------------------------------------------

    def on_item(self, item: tuple[str, Any, Any]) -> None:
        kind, payload, extra = item
        if kind == "reg":
            self._on_registration(payload, extra)
        elif kind == "withdraw":
            self._withdraw(payload, extra)
        else:
            self._on_cancel(payload, bool(extra))

    def _on_registration(self, r: RecvRegistration, replay: tuple[int, Future[Any]] | None) -> None:
        if replay is None:
            self._start(r)
            return
        t = self.recvs.get(r.request_id)
        if t is None or t.reg is not r or t.state is not State.REGISTERED:
            # Cancelled, expired or already sent while the handshake ran (or failed by
            # another rank's). Still finished, so the table keeps no ended handshake (a
            # failed one would otherwise fail every later registration with that rank).
            try:
                self.s.peers.load(r.remote_host, replay[0], replay[1])
            except (HandshakeError, TransportError):
                pass
            return
        try:
            self.s.peers.load(r.remote_host, replay[0], replay[1])
        except (HandshakeError, TransportError) as e:
            self.s.stats["handshake_failed"] += 1
            self._end(t, State.FAILED, "failed", f"handshake with P failed: {e}")
            return
        self._try_send(t, recheck=False)

    def _start(self, r: RecvRegistration) -> None:
        if r.request_id in self.recvs:
            log.warning("request %s registered twice; ignoring the second", r.request_id)
            return
        t = RecvTransfer(r, stats=self.s.stats)
        self.recvs[r.request_id] = t
        entered(t, t.name)
        try:
            validate_block_ids(self.s.layout, r.block_ids)
        except LayoutError as e:
            self._end(t, State.FAILED, "failed", f"bad local block ids: {e}")
            return
        ranks = r.remote_tp_size * r.remote_pp_size
        if min(r.remote_tp_size, r.remote_pp_size) < 1 or ranks > wire.MAX_TP:
            self._end(t, State.FAILED, "failed", f"{ranks} prefiller ranks (1 to {wire.MAX_TP})")
            return
        if not 0 <= r.remote_port <= 65536 - ranks:  # (the vLLM side refuses port 0 too)
            self._end(t, State.FAILED, "failed", f"prefiller port {r.remote_port} out of range")
            return
        self._try_send(t, recheck=True)

    def _try_send(self, t: RecvTransfer, recheck: bool) -> None:
        """Send PUSH_REG to every P rank once all are connected (handshakes run at once)."""
        r = t.reg
        ranks = self._p_ranks(r)
        peers = [
            self.s.peers.ensure(r.remote_host, port, self._replay(r, port)) for port, _ in ranks
        ]
        ready = [p for p in peers if p is not None]
        if len(ready) < len(peers):
            return
        stale = [p for p in ready if self.s.peers.silent(p) and not self._in_use(p.agent)]
        if recheck and stale:
            # Silent P ranks may have restarted as new agents: handshake again first.
            for p in stale:
                self.s.peers.forget(p.agent)
            self._try_send(t, recheck=False)
            return
        try:
            for peer in ready:
                self.s.peers.check_from(peer)
        except LayoutError as e:
            self._end(t, State.FAILED, "failed", f"prefiller's KV layout is incompatible: {e}")
            return
        msg = self._push_reg(r)
        for peer, (_, src) in zip(ready, ranks, strict=True):
            if not self.s.notify(peer.agent, self.copies.offer(t.rid, peer, msg) if src else msg):
                self._end(
                    t, State.FAILED, "failed", f"could not send the registration to {peer.agent}"
                )
                return
        t.agents = [p.agent for p in ready]
        t.sources = [p.agent for p, (_, src) in zip(ready, ranks, strict=True) if src]
        self.copies.expect(t.rid, len(t.sources))
        t.sent_at = time.monotonic()
        transition(t, State.AWAITING, t.name, f"registered with {len(t.agents)} P ranks")

    def poll_copies(self) -> int:
        """Count the completions of same-host copies that reported their end; how many."""
        seen = self.copies.poll()
        for rid, agent in seen:
            self._completion(agent, rid)
        return len(seen)

    def _in_use(self, agent: str) -> bool:
        """A receive waits on the agent, or a hold names it: a hold ends early only by
        probing its writers (``_end_holds``), which a forgotten peer never is."""
        if any(agent in writers for _, writers in self.holds.values()):
            return True
        return any(
            agent in t.agents for t in self.recvs.values() if t.state is not State.REGISTERED
        )

    def _replay(
        self, r: RecvRegistration, port: int, kind: str = "reg"
    ) -> Callable[[Future[Any]], None]:
        return lambda f: self.reg_send_inbox.put((kind, r, (port, f)))

    def _p_ranks(self, r: RecvRegistration) -> list[tuple[int, bool]]:
        """(side-channel port, writes to us) of each P rank; port = rank 0's + stage * tp + rank."""
        cfg = self.s.config
        # A set: membership per rank in O(1) (a list made this quadratic in the TP size).
        srcs = set(d_sources(cfg.tp_rank, cfg.tp_size, r.remote_tp_size, self.s.layout.attention))
        return [
            (r.remote_port + stage * r.remote_tp_size + i, i in srcs)
            for stage in range(r.remote_pp_size)
            for i in range(r.remote_tp_size)
        ]

    def _push_reg(self, r: RecvRegistration) -> wire.PushReg:
        cfg = self.s.config
        return wire.PushReg(
            request_id=r.request_id,
            decode_engine_id=cfg.engine_id,
            decode_host=cfg.host,
            decode_port=cfg.port,
            decode_tp_size=cfg.tp_size,
            local_block_ids=r.block_ids,
            remote_engine_id=r.remote_engine_id,
            remote_host=r.remote_host,
            remote_port=r.remote_port,
            remote_tp_size=r.remote_tp_size,
            transfer_id=r.transfer_id,
            decode_tp_rank=cfg.tp_rank,
            prompt=msgspec.UNSET if r.prompt is None else r.prompt,
        )

    def _on_cancel(self, rid: str, expired: bool) -> None:
        t = self.recvs.get(rid)
        if t is None:
            # Registrations and cancels share one FIFO: the receive already ended and its
            # outcome went out. The scheduler turns that outcome into the release; a second
            # report of the same id would crash vLLM's scheduler (it asserts one report).
            self.s.stats["cancel_after_end"] += 1
            return
        t.aborted = t.aborted or not expired
        if t.state is State.AWAITING:
            self._cancel_sources(t)
        if not expired and t.state is State.CANCELLING and not t.quiet:
            # Fence: keep the blocks until every P rank confirms nothing is in flight.
            return
        if expired:
            reason = t.fail_reason or "watchdog expired: no KV from the prefiller in time"
            if not t.quiet and self.hold_s > 0:
                # P ranks send heartbeats while they hold the registration: expiry means
                # silence, and a partition looks the same. A WRITE posted before it can
                # still land once the link heals: fail now, keep the blocks (late_writes).
                why = f"{reason} (blocks held {self.hold_s:g} s)"
                self._end(t, State.EXPIRED, "held", why, t.reg.block_ids)
                writers = set(t.sources) - t.done_from
                self.holds[t.rid] = (time.monotonic() + self.hold_s, writers)
                self.s.stats["recv_held"] += 1
                return
            self._end(t, State.EXPIRED, "released" if t.aborted else "failed", reason)
        else:
            self._end(t, State.CANCELLED, "released", "cancelled before P could write")

    def _withdraw(self, r: RecvRegistration, replay: tuple[int, Future[Any]] | None) -> None:
        """Tell each P rank that ``r`` will never register (handshaking first if need be),
        so it frees what it keeps for it now. An unreachable P rank frees it at its lease."""
        ports = [port for port, _ in self._p_ranks(r)]
        if replay is not None:
            ports = [replay[0]]
            try:
                self.s.peers.load(r.remote_host, replay[0], replay[1])
            except (HandshakeError, TransportError) as e:
                log.info(
                    "withdrawal of %s not sent to %s:%d: %s",
                    r.request_id,
                    r.remote_host,
                    ports[0],
                    e,
                )
                return
        cancel = wire.PushCancel(request_id=r.request_id, transfer_id=r.transfer_id, withdrawn=True)
        if trace.ON:
            trace.mark("d_consumer.withdraw", r.transfer_id, r.request_id)
        for port in ports:
            replayed = self._replay(r, port, "withdraw")
            peer = self.s.peers.ensure(r.remote_host, port, replayed)
            if peer is not None and self.s.notify(peer.agent, cancel):
                self.s.stats["withdrawn"] += 1

    def _cancel_sources(self, t: RecvTransfer) -> None:
        """Ask every P rank to stop; wait (CANCELLING) for the sources still writing. A
        source whose answer is in (its PUSH_FAIL, say) has ended its part: not asked."""
        cancel = wire.PushCancel(request_id=t.rid, transfer_id=t.reg.transfer_id)
        for agent in t.agents:
            if agent in t.done_from:
                continue
            if not self.s.notify(agent, cancel) and agent in t.sources:
                t.done_from.add(agent)  # gone: nothing of it will land any more
        transition(t, State.CANCELLING, t.name, "waiting for P ranks to confirm")

    def _settle(self, t: RecvTransfer) -> None:
        """End a CANCELLING receive once no source can write any more."""
        if t.state is State.CANCELLING and t.quiet:
            if t.aborted:
                self._end(t, State.CANCELLED, "released", "P confirmed")
            else:
                self._end(t, State.FAILED, "failed", t.fail_reason)

    # ---- notifications from P ------------------------------------------------------------

    def on_completion(self, sender: str, c: wire.Completion) -> None:
        self._completion(sender, c.request_id)

    def _completion(self, sender: str, rid: str) -> None:
        """A source says every byte of its part is in our blocks (or nothing was due)."""
        t = self.recvs.get(rid)
        if t is None and rid in self.holds:
            self.s.stats["completion_held"] += 1  # the late WRITE the hold is for
            log.info("late completion for %s from %s: its blocks are held", rid, sender)
            return
        if t is None:
            self.s.stats["completion_unknown"] += 1
            log.warning("completion for unknown request %s from %s", rid, sender)
            return
        if sender not in t.sources or sender in t.done_from:
            self.s.stats["completion_wrong_sender"] += 1
            log.warning(
                "completion for %s from %s, expected one from %s",
                t.rid,
                sender,
                sorted(set(t.sources) - t.done_from),
            )
            return
        t.done_from.add(sender)
        if t.state is State.CANCELLING:
            self._settle(t)
            return
        if t.quiet:
            self._end(t, State.DONE, "recv")
            self.s.stats["recv_done"] += 1
            self.s.stats["recv_bytes"] += self._nbytes(t)

    def on_push_fail(self, sender: str, f: wire.PushFail) -> None:
        t = self.recvs.get(f.request_id)
        if t is None or sender not in t.agents:
            self.s.stats["fail_unknown"] += 1
            log.warning("PUSH_FAIL for unknown request %s from %s", f.request_id, sender)
            return
        if sender in t.sources:
            t.done_from.add(sender)
        if t.state is State.AWAITING and not (f.reason == "cancelled" and sender not in t.sources):
            # Fail, but only once the other sources can no longer write into the blocks.
            t.fail_reason = f"prefiller gave up: {f.reason}"
            t.fail_cause = f.cause if isinstance(f.cause, str) else ""
            self._cancel_sources(t)
        self._settle(t)

    def on_heartbeat(self, sender: str, hb: wire.Heartbeat) -> None:
        for e in hb.entries:
            t = self.recvs.get(e.request_id)
            if t is not None and sender in t.agents:
                self.s.emit("renewed", t.rid)

    def on_timer(self, now: float) -> None:
        if self.holds:
            self._end_holds(now)
        held: dict[str, list[wire.HbEntry]] = defaultdict(list)
        for t in self.recvs.values():
            if t.state is State.AWAITING:
                for agent in t.agents:
                    held[agent].append(wire.HbEntry(t.rid, t.reg.transfer_id))
        for agent, entries in held.items():
            self.s.notify(agent, wire.Heartbeat(entries=entries))

    def _end_holds(self, now: float) -> None:
        """Release the holds whose time is up or whose writers' connections all failed
        (a dead P: nothing more can arrive from it). A writer still connected is probed
        with an empty heartbeat, which fails once its connection did."""
        peers, probed = self.s.peers, set[str]()
        for rid, (until, writers) in list(self.holds.items()):
            for agent in writers - probed:
                probed.add(agent)
                if agent in peers.by_agent:  # a failed send marks it failed (worker.notify)
                    self.s.notify(agent, wire.Heartbeat(entries=[]))
            writers.difference_update(a for a in list(writers) if a in peers.failed)
            if until <= now or not writers:
                del self.holds[rid]
                self.s.emit("released", rid)  # no WRITE of it can land any more

    def _nbytes(self, t: RecvTransfer) -> int:
        per = self._block_bytes
        if per is None:  # once: a model has hundreds of regions, a receive ends every step
            layout = self.s.layout
            per = self._block_bytes = [0] * layout.groups
            for i, r in enumerate(layout.regions):
                per[r.group] += layout.logical_bytes(i)
        ids = t.reg.block_ids
        return sum(n * len(ids[g]) for g, n in enumerate(per))

    def _end(
        self, t: RecvTransfer, state: State, kind: str, reason: str = "", blocks: Any = None
    ) -> None:
        was = t.state
        transition(t, state, t.name, reason)
        if state is State.FAILED or state is State.EXPIRED:
            log.warning("receive %s ended %s: %s", t.name, state.value, reason)
            failed = _FAILED_BY.get(t.fail_cause, "recv_failed")
            self.s.stats[failed if state is State.FAILED else "recv_expired"] += 1
        elif state is State.DONE and was is State.AWAITING and t.sent_at:
            self.s.observe("kv_wait_seconds", time.monotonic() - t.sent_at)
        if self.recvs.pop(t.rid, None) is t:
            self.copies.release(t.rid)  # its words still awaited
        self.s.emit(kind, t.rid, reason, blocks)
