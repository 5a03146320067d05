"""D side of the writer: send registrations to P and account for completions.

Registrations and cancels share one inbox so a cancel is always handled after
the registration it cancels. Owned by the writer thread.
"""

from __future__ import annotations

import logging
import queue
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, LayoutError, TransportError
from kvpush.core.layout import validate_block_ids
from kvpush.core.types import RecvRegistration, State, expected_writers, transition

if TYPE_CHECKING:
    from kvpush.core.worker import PushWorker

log = logging.getLogger(__name__)


@dataclass
class RecvTransfer:
    """One D request waiting for P's WRITE into its pre-allocated blocks."""

    reg: RecvRegistration
    state: State = State.REGISTERED
    p_agent: str | None = None
    expected: int = 1
    got: int = 0

    @property
    def rid(self) -> str:
        return self.reg.request_id

    @property
    def name(self) -> str:
        return self.reg.transfer_id or self.reg.request_id


class Consumer:
    def __init__(self, worker: PushWorker) -> None:
        self.w = worker
        # ("reg", RecvRegistration, handshake future or None) | ("cancel", request id, expired)
        self.reg_send_inbox: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self.recvs: dict[str, RecvTransfer] = {}

    def outstanding(self) -> int:
        return len(self.recvs)

    # ---- inbox -----------------------------------------------------------------------------

    def on_item(self, item: tuple[str, Any, Any]) -> None:
        kind, payload, extra = item
        if kind == "reg":
            self._on_registration(payload, extra)
        else:
            self._on_cancel(payload, bool(extra))

    def _on_registration(self, r: RecvRegistration, fut: Future[Any] | None) -> None:
        if fut is None:
            if r.request_id in self.recvs:
                log.warning("request %s registered twice; ignoring the second", r.request_id)
                return
            t = RecvTransfer(r)
            self.recvs[r.request_id] = t
            transition(t, State.REGISTERED, t.name)
            try:
                validate_block_ids(self.w.layout, r.block_ids)
            except LayoutError as e:
                self._end(t, State.FAILED, "failed", f"bad local block ids: {e}")
                return
        else:
            t_or_none = self.recvs.get(r.request_id)
            if (
                t_or_none is None
                or t_or_none.reg is not r
                or t_or_none.state is not State.REGISTERED
            ):
                return  # cancelled or expired while the handshake ran
            t = t_or_none
            try:
                self.w.load_peer(r.remote_host, r.remote_port + self._p_rank(r), fut)
            except (HandshakeError, TransportError) as e:
                self.w.stats["handshake_failed"] += 1
                self._end(t, State.FAILED, "failed", f"handshake with P failed: {e}")
                return
        p_port = r.remote_port + self._p_rank(r)
        peer = self.w.ensure_peer(
            r.remote_host,
            p_port,
            lambda f: self.reg_send_inbox.put(("reg", r, f)),
        )
        if peer is None:
            return
        try:
            self.w.check_from(peer)
        except LayoutError as e:
            self._end(t, State.FAILED, "failed", f"prefiller's KV layout is incompatible: {e}")
            return
        cfg = self.w.config
        msg = wire.PushReg(
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
            staging=self._offer(r),
        )
        if not self.w.notify(peer.agent, msg):
            self._end(t, State.FAILED, "failed", "could not send the registration to P")
            return
        t.p_agent = peer.agent
        t.expected = expected_writers(r.remote_tp_size, cfg.tp_size)
        transition(t, State.AWAITING, t.name, f"registered with {peer.agent}")

    def _p_rank(self, r: RecvRegistration) -> int:
        """The P rank whose side channel (rank 0's port + rank) this D rank registers with."""
        return self.w.config.tp_rank if r.remote_tp_size == self.w.config.tp_size else 0

    def _on_cancel(self, rid: str, expired: bool) -> None:
        t = self.recvs.get(rid)
        if t is None:
            if not expired:
                self.w.emit("released", rid)
            return
        if t.state is State.AWAITING and t.p_agent is not None:
            sent = self.w.notify(
                t.p_agent, wire.PushCancel(request_id=rid, transfer_id=t.reg.transfer_id)
            )
            if sent and not expired:
                # Fence: keep the blocks until P confirms nothing is or will be in flight.
                transition(t, State.CANCELLING, t.name, "waiting for P to confirm")
                return
        if expired:
            # P sends heartbeats while it holds the registration: expiry means it went silent.
            reason = "watchdog expired: no KV from the prefiller in time"
            if t.state is State.CANCELLING:
                self._end(t, State.EXPIRED, "released", reason)
            else:
                self._end(t, State.EXPIRED, "failed", reason)
        else:
            self._end(t, State.CANCELLED, "released", "cancelled before P could write")

    # ---- notifications from P ------------------------------------------------------------

    def on_completion(self, sender: str, c: wire.Completion | wire.StagedDone) -> None:
        t = self.recvs.get(c.request_id)
        if t is None:
            self.w.stats["completion_unknown"] += 1
            log.warning("completion for unknown request %s from %s", c.request_id, sender)
            return
        if t.expected == 1 and t.p_agent is not None and sender != t.p_agent:
            self.w.stats["completion_wrong_sender"] += 1
            log.warning("completion for %s from %s, expected %s", t.rid, sender, t.p_agent)
            return
        if isinstance(c, wire.StagedDone) and t.state is not State.CANCELLING:
            if not self._unstage(t):
                return
        t.got += 1
        if t.got < t.expected:
            return
        if t.state is State.CANCELLING:
            self._end(t, State.CANCELLED, "released", "WRITE finished after cancel")
        else:
            self.w.stats["recv_done"] += 1
            self.w.stats["recv_bytes"] += self._nbytes(t)
            self._end(t, State.DONE, "recv")

    def on_push_fail(self, sender: str, f: wire.PushFail) -> None:
        t = self.recvs.get(f.request_id)
        if t is None or (t.p_agent is not None and sender != t.p_agent):
            self.w.stats["fail_unknown"] += 1
            log.warning("PUSH_FAIL for unknown request %s from %s", f.request_id, sender)
            return
        if t.state is State.CANCELLING:
            self._end(t, State.CANCELLED, "released", f"P confirmed: {f.reason}")
        else:
            self._end(t, State.FAILED, "failed", f"prefiller gave up: {f.reason}")

    def on_heartbeat(self, sender: str, hb: wire.Heartbeat) -> None:
        for e in hb.entries:
            t = self.recvs.get(e.request_id)
            if t is not None and t.p_agent == sender:
                self.w.emit("renewed", t.rid)

    def on_timer(self, now: float) -> None:
        del now
        held: dict[str, list[wire.HbEntry]] = defaultdict(list)
        for t in self.recvs.values():
            if t.p_agent is not None and t.state is State.AWAITING:
                held[t.p_agent].append(wire.HbEntry(t.rid, t.reg.transfer_id))
        for agent, entries in held.items():
            self.w.notify(agent, wire.Heartbeat(entries=entries))

    def _nbytes(self, t: RecvTransfer) -> int:
        layout = self.w.layout
        return sum(
            layout.logical_bytes(i) * len(t.reg.block_ids[r.group])
            for i, r in enumerate(layout.regions)
        )

    def _offer(self, r: RecvRegistration) -> wire.StagingSlot | msgspec.UnsetType:
        """A staging slot for P's single WRITE (same TP on both sides only), else UNSET."""
        hook = self.w.staging
        if hook is None or r.remote_tp_size != self.w.config.tp_size:
            return msgspec.UNSET
        slot = hook.offer(r.request_id, r.block_ids)
        return msgspec.UNSET if slot is None else slot

    def _unstage(self, t: RecvTransfer) -> bool:
        """Scatter a staged WRITE into the request's blocks; False (and failed) on error."""
        try:
            if self.w.staging is None:
                raise LayoutError("staged completion, but this worker has no staging")
            self.w.staging.unstage(t.rid, t.reg.block_ids)
        except Exception as e:
            self.w.stats["unstage_failed"] += 1
            self._end(t, State.FAILED, "failed", f"scatter from staging failed: {e}")
            return False
        return True

    def _end(self, t: RecvTransfer, state: State, kind: str, reason: str = "") -> None:
        transition(t, state, t.name, reason)
        if state is State.FAILED or state is State.EXPIRED:
            log.warning("receive %s ended %s: %s", t.name, state.value, reason)
        self.recvs.pop(t.rid, None)
        if self.w.staging is not None:
            self.w.staging.release_recv(t.rid)
        self.w.emit(kind, t.rid, reason)
