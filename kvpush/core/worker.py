"""One push worker per TP rank, driven by the engine's thread.

The engine calls ``start_step`` and ``get_finished`` every step; both run the push's
work (a tick) on the calling thread, so nothing waits for a thread wake-up between a
finished prefill and its copy, or between a completion and the engine seeing it.
When the engine makes no call for a while (idle, or one long step) the keeper thread
ticks in its place; the two take one lock, so one thread at a time touches the
transport. Handshakes run on a pool; their done-callbacks re-enqueue the waiting
operation on its replay inbox. See docs/architecture.md for the threads, queues and
states.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvpush.core import wire
from kvpush.core.consumer import Consumer
from kvpush.core.copy_route import CopyReceiver
from kvpush.core.errors import KVPushError, TransportError, WireError, worth_logging
from kvpush.core.handshake import PROTOCOL_VERSION, AgentInfo, SideChannelServer, fetch_agent_info
from kvpush.core.lane import host_identity
from kvpush.core.layout import KVLayout
from kvpush.core.peer_copy import PeerCopyHook
from kvpush.core.peers import PeerTable
from kvpush.core.producer import Producer
from kvpush.core.records import HandOver
from kvpush.core.shared import Shared
from kvpush.core.transport import Transport
from kvpush.core.types import StagedBlocks, StepMeta, WorkerConfig, WorkerOutput

log = logging.getLogger(__name__)

MAX_OBSERVED = 10_000
LANE_TICK_S = 1e-3  # only copies' lane words awaited: the full tick at most this often
KEEPER_S = 0.02  # the keeper polls when the engine made no call for this long


def make_agent_name(engine_id: str, tp_rank: int) -> str:
    # A fresh suffix per incarnation: a restarted peer is a new agent, never a stale one.
    return f"{engine_id}-tp{tp_rank}-{uuid.uuid4().hex[:8]}"


class PushWorker:
    """Engine-facing worker; call ``start_step`` and ``get_finished`` once per engine step."""

    def __init__(
        self,
        config: WorkerConfig,
        transport: Transport,
        layout: KVLayout,
        fetch: Callable[..., AgentInfo] = fetch_agent_info,
        peer_copy: PeerCopyHook | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.layout = layout
        self.stats: Counter[str] = Counter()
        # Latencies (seconds) by name, until the engine takes them (take_observations).
        self.observations: dict[str, list[float]] = {}
        transport.register(layout)
        self.peer_copy = peer_copy  # optional one-kernel copy into a same-host peer
        host = host_identity()
        # Where same-host copies into us report their end (a lane word): with a hook only.
        slots = config.lane_slots if peer_copy is not None else 0
        self.copies = CopyReceiver(slots, host, self.stats)
        self.info = AgentInfo(
            protocol_version=PROTOCOL_VERSION,
            engine_id=config.engine_id,
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            agent_name=transport.agent_name,
            nixl_metadata=transport.metadata(),
            layout=layout,
            peer_copy=peer_copy.export() if peer_copy is not None else None,
            lane=self.copies.name,
            host_id=host,
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._results: queue.SimpleQueue[tuple[str, str, str, Any]] = queue.SimpleQueue()
        self.peers = PeerTable(
            config,
            transport,
            layout,
            fetch,
            self.info.agent_name,
            self.stats,
            self._wake.set,
            peer_copy,
            self.info.host_id,
        )
        shared = Shared(
            config, layout, self.stats, self.peers, self.notify, self.emit, self.observe
        )
        self.producer = Producer(shared)
        self.consumer = Consumer(shared, self.copies)
        self._poll_s = config.poll_interval_s
        self._next_timers = 0.0
        # Nothing outstanding: get_finished ticks only when due (idle_poll_s); new work
        # comes through start_step, which always ticks.
        self._idle = False
        self._lanes_only = False  # only copies' lane words are awaited (see _timeout)
        self._keeper_running = True  # cleared by the keeper thread as it exits
        self._server = SideChannelServer(
            config.host, config.port, self.info, config.shared_secret, self.peers.authenticated.add
        )
        self._next_tick = 0.0  # when get_finished must tick even if idle
        # Requests handed over early (hand_over) until both their push ended and the engine
        # finished them (StepMeta.confirmed): only then is their "sent" reported.
        self._handed: dict[str, HandOver] = {}
        # The engine thread and the keeper take turns under this lock.
        self._lock = threading.Lock()
        self._engine_seen = time.monotonic()  # the engine's last call
        self._thread = threading.Thread(target=self._keep, name="kvpush-keeper", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------

    def start_step(self, meta: StepMeta) -> None:
        """This step's new work (the design's ``start_load_kv``): taken in, then one tick."""
        self.producer.pairing.took(meta)  # (engine thread only; the tick only reads it)
        if not meta:
            return  # (get_finished, called every step too, checks the keeper is alive)
        self._check_alive()
        with self._lock:
            self._engine_seen = time.monotonic()
            self._start_step(meta)

    def _start_step(self, meta: StepMeta) -> None:
        for rid in meta.confirmed:
            h = self._handed.get(rid)
            if h is not None and h.on_confirmed():
                del self._handed[rid]
                self.emit("sent", rid)  # its push ended before: reported at get_finished
        self._take_finished(meta.finished)  # first: its copy starts before anything else
        for reg in meta.registrations:
            self.consumer.reg_send_inbox.put(("reg", reg, None))
        for rid in meta.cancels:
            self.consumer.reg_send_inbox.put(("cancel", rid, False))
        for rid in meta.expired:
            self.consumer.reg_send_inbox.put(("cancel", rid, True))
        for reg in meta.withdrawn:
            self.consumer.reg_send_inbox.put(("withdraw", reg, None))
        for rid in meta.evictions:  # an eviction follows its request's finished blocks
            self._guard(self.producer.on_evict, rid)
        for rid, reason in meta.rejected.items():
            self.emit("failed", rid, reason)
        self._tick_now()

    def hand_over(self, early: list[StagedBlocks]) -> None:
        """Push the blocks of ``StepMeta.early`` now: called by the engine once the step's
        writes of them are queued (with ``after`` set when they are not done yet). Their
        finished_sending waits for ``StepMeta.confirmed``: until the engine has finished
        a request, its blocks are still the request's."""
        if not early:
            return
        self._check_alive()
        with self._lock:
            self.stats["handed_over"] += len(early)
            for s in early:
                self._handed[s.request_id] = HandOver(s.request_id)
            self._take_finished(early)
            self._tick_now()

    def _take_finished(self, finished: list[StagedBlocks]) -> None:
        for staged in finished:
            self._guard(self.producer.on_finished, staged)

    def get_finished(self) -> WorkerOutput:
        """Collect what finished since the last call, after polling if anything is due."""
        self._check_alive()
        with self._lock:
            self._engine_seen = time.monotonic()
            self._poll()
        self.producer.pairing.step_ended(self._engine_seen)
        out = WorkerOutput()
        results = self._results
        while not results.empty():  # the engine thread is the only consumer
            kind, rid, reason, blocks = results.get_nowait()
            if kind == "sent":
                h = self._handed.get(rid)
                if h is None or h.on_sent():  # else kept back until the engine finished it
                    self._handed.pop(rid, None)
                    out.finished_sending.add(rid)
            elif kind == "recv":
                out.finished_recving.add(rid)
            elif kind in ("failed", "held"):  # held: its blocks stay ours until "released"
                out.failed_recving[rid] = reason
                if kind == "held":
                    out.held[rid] = blocks
            elif kind == "released":
                out.released.add(rid)
            elif kind == "renewed":
                out.renewed.add(rid)
        return out

    def _poll(self) -> None:
        """Under the lock. A copy's lane word is a memory read: look every call (the tick
        reads them first). The whole tick runs every call while anything else is
        outstanding, else when a handshake callback woke us or the timer is due."""
        busy = not self._idle and not self._lanes_only
        if busy or self._wake.is_set() or time.monotonic() >= self._next_tick:
            self._tick_now()
        elif self.copies.waiting:
            self.consumer.poll_copies()

    def _keep(self) -> None:
        """Poll in the engine's place while it makes no calls (idle, or
        in a long step), so registrations are read and heartbeats, leases and the
        watchdog keep their cadence. Silent while the engine calls often."""
        try:
            while not self._stop.wait(KEEPER_S):
                if time.monotonic() - self._engine_seen < KEEPER_S:
                    continue
                with self._lock:
                    if not self._stop.is_set():
                        self._poll()
        finally:
            self._keeper_running = False

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._server.close()
        self.peers.close()
        self.transport.close()
        self.copies.close()

    def handed_over(self, rid: str) -> HandOver | None:
        """The hand-over record of ``rid`` while its finished_sending is not reported."""
        return self._handed.get(rid)

    def keeper_alive(self) -> bool:
        return self._thread.is_alive()

    def _check_alive(self) -> None:
        # A flag the keeper clears as it exits: Thread.is_alive() takes a lock every step.
        if not self._keeper_running and not self._stop.is_set():
            raise KVPushError("kvpush keeper thread is not running")
        if not self._server.running and not self._stop.is_set():
            raise KVPushError("kvpush side channel thread is not running")

    # ---- shared services for producer and consumer ---------------------------------------

    def observe(self, name: str, seconds: float) -> None:
        """Record one latency; an engine that never takes them keeps the last MAX_OBSERVED."""
        got = self.observations.setdefault(name, [])
        got.append(seconds)
        if len(got) > MAX_OBSERVED:
            del got[: len(got) - MAX_OBSERVED]

    def take_observations(self) -> dict[str, list[float]]:
        """The latencies recorded since the last call (any thread; the dict is swapped)."""
        if not self.observations:
            return {}
        out, self.observations = self.observations, {}
        return out

    def emit(self, kind: str, rid: str, reason: str = "", blocks: Any = None) -> None:
        self._results.put((kind, rid, reason, blocks))

    def notify(self, agent: str, msg: wire.Message) -> bool:
        """Send a notification; False (and the peer forgotten if dead) on failure."""
        try:
            self.transport.send_notif(agent, wire.encode(msg))
            return True
        except (TransportError, WireError) as e:
            self.stats["notify_failed"] += 1
            log.warning("notification %s to %s failed: %s", type(msg).__name__, agent, e)
            if isinstance(e, TransportError):
                self.peers.forget(agent, failed=True)
            return False

    def drain(self, inbox: queue.SimpleQueue[Any], handler: Callable[[Any], None]) -> int:
        n = 0
        while True:
            try:
                item = inbox.get_nowait()
            except queue.Empty:
                return n
            n += 1
            self._guard(handler, item)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a bug handling one item must not stop the engine or the keeper
            self.stats["writer_errors"] += 1
            log.exception("kvpush: %s failed", getattr(fn, "__name__", fn))

    # ---- the tick (engine thread, or the keeper in its place; under the lock) -------------

    def _tick_now(self) -> None:
        self._wake.clear()  # set by handshake callbacks: tick at the next get_finished
        try:
            self._tick()
        except Exception:  # count, log, keep the engine (or the keeper) going
            self.stats["writer_errors"] += 1
            log.exception("kvpush tick failed")
        self._next_tick = time.monotonic() + self._timeout()

    def _tick(self) -> None:
        p, c = self.producer, self.consumer
        busy = c.poll_copies()  # first: the cheapest way a receive can end
        busy += self.drain(c.reg_send_inbox, c.on_item)
        busy += self.drain(p.deferred_push_inbox, p.on_deferred)
        busy += self._poll_notifs()
        busy += p.sender.check()
        now = time.monotonic()
        if now >= self._next_timers:
            self._next_timers = now + self.config.heartbeat_interval_s
            self._guard(c.on_timer, now)
            self._guard(p.on_timer, now)
        # Poll fast right after activity, back off while nothing happens.
        if busy:
            self._poll_s = self.config.poll_interval_s
        else:
            self._poll_s = min(self._poll_s * 2, self.config.max_poll_interval_s)

    def _timeout(self) -> float:
        cfg = self.config
        idle = lanes = False
        if self.producer.has_unmatched():
            wait = cfg.match_poll_s
        elif self.producer.sender.busy() or self.peers.handshakes:
            wait = self._poll_s
        elif self.consumer.outstanding():
            # get_finished reads the lane every call: while only lane words are awaited,
            # notifications (a PUSH_FAIL, heartbeats) can wait for the slow poll.
            lanes = self.consumer.only_copies()
            wait = max(cfg.max_poll_interval_s, LANE_TICK_S) if lanes else self._poll_s
        else:
            wait, idle = cfg.idle_poll_s, True
        self._idle = idle
        self._lanes_only = lanes
        return max(0.0, min(wait, self._next_timers - time.monotonic()))

    def _poll_notifs(self) -> int:
        try:
            notifs = self.transport.get_notifs()
        except TransportError as e:
            log.warning("polling notifications failed: %s", e)
            return 0
        now = time.monotonic()
        for sender, raw in notifs:
            if self.config.shared_secret is not None and not self._authentic(sender):
                continue
            self.peers.heard[sender] = now
            try:
                msg = wire.decode(raw)
            except WireError as e:
                self.stats["rejected"] += 1
                log.warning("rejected notification from %s: %s", sender, e)
                continue
            self._guard(self._dispatch, sender, msg)
        return len(notifs)

    def _authentic(self, sender: str) -> bool:
        """With a secret: did the sender prove it in a handshake with us, either way (our
        peers did, through our verified fetch)? If not, its notification is dropped."""
        if sender in self.peers.by_agent or sender in self.peers.authenticated:
            return True
        self.stats["notif_unauthenticated"] += 1
        n = self.stats["notif_unauthenticated"]
        if worth_logging(n):
            log.warning("notification from unauthenticated agent %r dropped (#%d)", sender, n)
        return False

    def _dispatch(self, sender: str, msg: wire.Message) -> None:
        if isinstance(msg, wire.PushReg):
            self.producer.on_push_reg(sender, msg)
        elif isinstance(msg, wire.Completion):
            self.consumer.on_completion(sender, msg)
        elif isinstance(msg, wire.PushFail):
            self.consumer.on_push_fail(sender, msg)
        elif isinstance(msg, wire.PushCancel):
            self.producer.on_cancel(sender, msg)
        elif isinstance(msg, wire.Heartbeat):
            self.consumer.on_heartbeat(sender, msg)
            self.producer.on_heartbeat(sender, msg)

    # ---- introspection (any thread; approximate while running) -----------------------------

    def snapshot(self) -> dict[str, int]:
        return {
            **self.stats,
            "staged": len(self.producer.staged),
            "pending_registrations": len(self.producer.pending_regs),
            "writing": len(self.producer.sender.writing),
            "receiving": self.consumer.outstanding(),
            **self._server.counts(),
        }
