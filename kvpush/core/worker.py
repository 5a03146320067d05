"""One push worker per TP rank: the engine-thread API and the writer thread.

The writer thread is the only thread that touches the transport after start-up.
The engine thread feeds it through single-consumer inboxes (``start_step``) and
reads results back (``get_finished``). Handshakes run on a background executor;
their done-callbacks re-enqueue the waiting operation on its replay inbox and
wake the writer. With ``writer="inline"`` there is no writer thread: the engine
thread runs the same tick inside ``start_step`` and ``get_finished`` (no thread
wake-ups between a finished prefill and its copy, or between a completion and
the engine seeing it). See docs/architecture.md for the threads, queues and states.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpush.core import wire
from kvpush.core.consumer import Consumer
from kvpush.core.errors import KVPushError, TransportError, WireError
from kvpush.core.handshake import (
    PROTOCOL_VERSION,
    AgentInfo,
    AgentSet,
    SideChannelServer,
    fetch_agent_info,
)
from kvpush.core.lane import CompletionLane, host_identity
from kvpush.core.layout import KVLayout, block_descs, group_limits, same_block_shape
from kvpush.core.peer_copy import PeerCopyHook
from kvpush.core.producer import Producer
from kvpush.core.routing import RegionPair, block_pieces, pair_regions
from kvpush.core.staging import StagingHook
from kvpush.core.transport import Transport
from kvpush.core.types import StagedBlocks, StepMeta, WorkerConfig, WorkerOutput

log = logging.getLogger(__name__)

PeerKey = tuple[str, int]
MAX_OBSERVED = 10_000
LANE_TICK_S = 1e-3  # inline, only lane words awaited: the full tick at most this often
KEEPER_S = 0.02  # inline: the keeper polls when the engine made no call for this long


@dataclass
class Peer:
    key: PeerKey
    info: AgentInfo
    prepped: object | None = None  # the peer's block descriptors, prepared (prepped mode)
    pairs: list[RegionPair] | None = None  # our regions into the peer's, once computed
    pieces: np.ndarray | None = None  # the same as block_pieces rows, once computed
    limits: list[int] | None = None  # logical blocks per group of its layout, once computed
    copy_declined: bool = False  # the peer-copy hook cannot reach this peer: WRITE only
    writes_to_us: bool = False  # its layout was checked to write into ours

    @property
    def agent(self) -> str:
        return self.info.agent_name


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
        staging: StagingHook | None = None,
        peer_copy: PeerCopyHook | None = None,
    ) -> None:
        self.config = config
        self._fetch = fetch  # tests substitute a gated or failing handshake
        self.transport = transport
        self.layout = layout
        self.stats: Counter[str] = Counter()
        # Latencies (seconds) by name, until the engine takes them (take_observations).
        self.observations: dict[str, list[float]] = {}
        transport.register(layout)
        self.staging = staging  # optional gather / one WRITE / scatter path (core/staging.py)
        if staging is not None:
            transport.register(KVLayout([staging.region], layout.block_size, 1, layout.mem_type))
        self.peer_copy = peer_copy  # optional one-kernel copy into a same-host peer
        # Where same-host peers' copies report their end (core/lane.py): D's side of the
        # peer-copy hook, so only workers that can be copied into have one.
        self.lane: CompletionLane | None = None
        if peer_copy is not None and config.lane_slots:
            try:
                self.lane = CompletionLane(config.lane_slots)
            except OSError as e:  # no /dev/shm: completions keep going over NIXL
                log.warning("no completion lane (%s); copies notify over NIXL", e)
        self.limits = group_limits(layout)  # ids of group g lie below limits[g]
        self.local_prepped: object | None = None
        if config.descriptor_mode == "prepped":
            self.local_prepped = transport.prep(None, block_descs(layout))
        self.info = AgentInfo(
            protocol_version=PROTOCOL_VERSION,
            engine_id=config.engine_id,
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            agent_name=transport.agent_name,
            nixl_metadata=transport.metadata(),
            layout=layout,
            staging=staging.region if staging is not None else None,
            peer_copy=peer_copy.export() if peer_copy is not None else None,
            lane=self.lane.name if self.lane is not None else None,
            host_id=host_identity(),
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._results: queue.SimpleQueue[tuple[str, str, str]] = queue.SimpleQueue()
        self.peers: dict[PeerKey, Peer] = {}
        self.peers_by_agent: dict[str, Peer] = {}
        self.heard: dict[str, float] = {}  # agent -> when we last received anything from it
        self._hs_futures: dict[PeerKey, Future[AgentInfo]] = {}
        self._executor = ThreadPoolExecutor(config.handshake_workers, "kvpush-handshake")
        self.producer = Producer(self)
        self.consumer = Consumer(self)
        self._poll_s = config.poll_interval_s
        self._next_timers = 0.0
        # Set by the writer while nothing is outstanding (it sleeps idle_poll_s): steps
        # then need not wake it, new work comes through start_step, which always does.
        self._writer_idle = False
        self._lanes_only = False  # inline: only lane words are awaited (see _timeout)
        self._writer_running = True  # cleared by the writer thread as it exits
        # With a secret: the agents that proved it to us, either way (see _poll_notifs).
        self.authenticated = AgentSet()
        self._server = SideChannelServer(
            config.host, config.port, self.info, config.shared_secret, self.authenticated.add
        )
        # writer="inline": the engine thread ticks in start_step / get_finished instead.
        self.inline = config.writer == "inline"
        self._next_tick = 0.0  # inline: when get_finished must tick even if idle
        # Requests handed over early (hand_over) that the engine has not finished yet: their
        # "sent" waits in _kept until start_step brings their confirmation.
        self._early: set[str] = set()
        self._kept: set[str] = set()
        self._sent_now: set[str] = set()  # confirmed after they were sent: next get_finished
        # Inline: the engine thread and the keeper take turns under this lock.
        self._lock = threading.Lock()
        self._engine_seen = time.monotonic()  # inline: the engine's last call
        self._thread: threading.Thread | None = None
        if not self.inline:
            self._thread = threading.Thread(target=self._run, name="kvpush-writer", daemon=True)
        else:
            self._thread = threading.Thread(target=self._keep, name="kvpush-keeper", daemon=True)
        self._thread.start()

    # ---- engine thread -------------------------------------------------------------------

    def start_step(self, meta: StepMeta) -> None:
        """Hand the writer this step's new work (the design's ``start_load_kv``)."""
        if not meta:
            return  # (get_finished, called every step too, checks the writer is alive)
        self._check_alive()
        with self._lock:
            self._engine_seen = time.monotonic()
            self._start_step(meta)

    def _start_step(self, meta: StepMeta) -> None:
        for rid in meta.confirmed:
            if rid in self._kept:
                self._kept.discard(rid)
                self._sent_now.add(rid)
            self._early.discard(rid)
        if self.inline:  # straight to the producer: its copy starts before anything else
            self._take_finished(meta.finished)
        for reg in meta.registrations:
            self.consumer.reg_send_inbox.put(("reg", reg, None))
        for rid in meta.cancels:
            self.consumer.reg_send_inbox.put(("cancel", rid, False))
        for rid in meta.expired:
            self.consumer.reg_send_inbox.put(("cancel", rid, True))
        for reg in meta.withdrawn:
            self.consumer.reg_send_inbox.put(("withdraw", reg, None))
        if not self.inline:
            self._take_finished(meta.finished)
        for rid in meta.evictions:
            self.producer.evict_finished_inbox.put(rid)
        for rid, reason in meta.rejected.items():
            self.emit("failed", rid, reason)
        self._kick()

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
            self._early.update(s.request_id for s in early)
            self._take_finished(early)
            self._kick()

    def _take_finished(self, finished: list[StagedBlocks]) -> None:
        """Finished blocks to the producer: directly (inline) or through its inbox."""
        for staged in finished:
            if self.inline:
                self._guard(self.producer.on_finished, staged)
            else:
                self.producer.finished_blocks_inbox.put(staged)

    def _kick(self) -> None:
        """New work was handed over: tick now (inline) or wake the writer."""
        if self.inline:
            self._inline_tick()
        else:
            self._wake.set()

    def get_finished(self) -> WorkerOutput:
        """Collect what finished since the last call; wakes the writer to poll unless idle."""
        self._check_alive()
        if self.inline:
            with self._lock:
                self._engine_seen = time.monotonic()
                self._inline_poll()
        out = WorkerOutput()
        if self._sent_now:
            out.finished_sending, self._sent_now = self._sent_now, set()
        results = self._results
        while not results.empty():  # the engine thread is the only consumer
            kind, rid, reason = results.get_nowait()
            if kind == "sent":
                if rid in self._early:  # not finished by the engine yet: keep it back
                    self._kept.add(rid)
                else:
                    out.finished_sending.add(rid)
            elif kind == "recv":
                out.finished_recving.add(rid)
            elif kind == "failed":
                out.failed_recving[rid] = reason
            elif kind == "released":
                out.released.add(rid)
            elif kind == "renewed":
                out.renewed.add(rid)
        if not self._writer_idle and not self.inline:
            self._wake.set()
        return out

    def _inline_poll(self) -> None:
        """writer="inline", under the lock. A lane word is a memory read: look every call
        (the tick reads the lane first). The whole tick runs every call while anything
        else is outstanding, else when woken or due."""
        busy = not self._writer_idle and not self._lanes_only
        if busy or self._wake.is_set() or time.monotonic() >= self._next_tick:
            self._inline_tick()
        elif self.lane is not None and self.lane.waiting:
            self.consumer.poll_lane()

    def _keep(self) -> None:
        """writer="inline": poll in the engine's place while it makes no calls (idle, or
        in a long step), so registrations are read and heartbeats, leases and the
        watchdog keep their cadence. Silent while the engine calls often."""
        try:
            while not self._stop.wait(KEEPER_S):
                if time.monotonic() - self._engine_seen < KEEPER_S:
                    continue
                with self._lock:
                    if not self._stop.is_set():
                        self._inline_poll()
        finally:
            self._writer_running = False

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
        if self.lane is not None:
            self.lane.close()

    def writer_alive(self) -> bool:
        """The writer thread (or, inline, the keeper thread) runs."""
        return self._thread is None or self._thread.is_alive()

    def _check_alive(self) -> None:
        # A flag the writer clears as it exits: Thread.is_alive() takes a lock every step.
        if not self._writer_running and not self._stop.is_set():
            raise KVPushError("kvpush writer thread is not running")

    # ---- shared services for producer and consumer (writer thread) -------------------------

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

    def emit(self, kind: str, rid: str, reason: str = "") -> None:
        self._results.put((kind, rid, reason))

    def ensure_peer(
        self, host: str, port: int, replay: Callable[[Future[AgentInfo]], None]
    ) -> Peer | None:
        """The ready peer, or None after arranging ``replay(future)`` once its handshake ends."""
        key = (host, port)
        peer = self.peers.get(key)
        if peer is not None:
            return peer
        fut = self._hs_futures.get(key)
        if fut is None:
            fut = self._executor.submit(
                self._fetch,
                host,
                port,
                self.config.engine_id,
                self.config.handshake_timeout_s,
                # (layouts are checked per direction on the writer: pairs_to / check_from)
                secret=self.config.shared_secret,
                agent=self.info.agent_name,  # the name the peer will hear us under
            )
            self._hs_futures[key] = fut
            self.stats["handshakes"] += 1

        def done(f: Future[AgentInfo]) -> None:
            replay(f)
            self._wake.set()

        fut.add_done_callback(done)
        return None

    def load_peer(self, host: str, port: int, fut: Future[AgentInfo]) -> Peer:
        """Finish a handshake on the writer: raises HandshakeError or TransportError."""
        key = (host, port)
        if self._hs_futures.get(key) is fut:
            del self._hs_futures[key]
        peer = self.peers.get(key)
        if peer is not None:
            return peer
        info = fut.result()
        self.authenticated.add(info.agent_name)  # it proved the secret, if we have one
        old = self.peers_by_agent.get(info.agent_name)
        if old is not None:  # same agent reached under another address
            self.peers[key] = old
            return old
        self.transport.add_peer(info.agent_name, info.nixl_metadata)
        peer = Peer(key, info)
        if self.local_prepped is not None and same_block_shape(self.layout, info.layout):
            peer.prepped = self.transport.prep(info.agent_name, block_descs(info.layout))
        self.peers[key] = peer
        self.peers_by_agent[info.agent_name] = peer
        self.heard[info.agent_name] = time.monotonic()  # the handshake is a sign of life
        where = "same host" if info.host_id == self.info.host_id else "another host"
        log.info("connected to %s (%s:%d, %s)", info.agent_name, host, port, where)
        return peer

    def silent(self, peer: Peer) -> bool:
        """True when nothing came from the peer for a while: it may have restarted."""
        quiet = time.monotonic() - self.heard.get(peer.agent, 0.0)
        return quiet > max(3 * self.config.heartbeat_interval_s, 2.0)

    def pairs_to(self, peer: Peer) -> list[RegionPair]:
        """How our regions map into the peer's (computed once); raises LayoutError."""
        if peer.pairs is None:
            peer.pairs = pair_regions(self.layout, peer.info.layout)
        return peer.pairs

    def limits_of(self, peer: Peer) -> list[int]:
        """``group_limits`` of the peer's layout (computed once)."""
        if peer.limits is None:
            peer.limits = group_limits(peer.info.layout)
        return peer.limits

    def pieces_to(self, peer: Peer) -> np.ndarray:
        """``block_pieces`` of our regions into the peer's (computed once)."""
        if peer.pieces is None:
            peer.pieces = block_pieces(self.layout, peer.info.layout, self.pairs_to(peer))
        return peer.pieces

    def check_from(self, peer: Peer) -> None:
        """Raise LayoutError unless the peer can write into our layout (checked once)."""
        if not peer.writes_to_us:
            pair_regions(peer.info.layout, self.layout)
            peer.writes_to_us = True

    def forget_peer(self, agent: str) -> None:
        """Drop a peer that died; the next operation towards it handshakes afresh."""
        peer = self.peers_by_agent.pop(agent, None)
        if peer is None:
            return
        for key in [k for k, p in self.peers.items() if p is peer]:
            del self.peers[key]
        if peer.prepped is not None:
            self.transport.release_prepped(peer.prepped)
        if self.peer_copy is not None:
            self.peer_copy.forget(agent)
        self.transport.remove_peer(agent)
        self.heard.pop(agent, None)
        log.info("peer %s forgotten", agent)

    def notify(self, agent: str, msg: wire.Message) -> bool:
        """Send a notification; False (and the peer forgotten if dead) on failure."""
        try:
            self.transport.send_notif(agent, wire.encode(msg))
            return True
        except (TransportError, WireError) as e:
            self.stats["notify_failed"] += 1
            log.warning("notification %s to %s failed: %s", type(msg).__name__, agent, e)
            if isinstance(e, TransportError):
                self.forget_peer(agent)
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
        except Exception:  # a bug handling one item must not stop the writer
            self.stats["writer_errors"] += 1
            log.exception("kvpush writer: %s failed", getattr(fn, "__name__", fn))

    # ---- writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self._timeout())
                self._wake.clear()
                self._guarded_tick()
        finally:
            self._writer_running = False

    def _guarded_tick(self) -> None:
        try:
            self._tick()
        except Exception:  # count, log, keep the writer (or the engine, inline) going
            self.stats["writer_errors"] += 1
            log.exception("kvpush writer tick failed")

    def _inline_tick(self) -> None:
        """writer="inline": one writer tick on the calling (engine) thread."""
        self._wake.clear()  # set by handshake callbacks: tick at the next get_finished
        self._guarded_tick()
        self._next_tick = time.monotonic() + self._timeout()

    def _tick(self) -> None:
        p, c = self.producer, self.consumer
        busy = c.poll_lane()  # first: the cheapest way a receive can end
        # Finished blocks before evictions: an eviction always follows its request's staging.
        busy += self.drain(p.finished_blocks_inbox, p.on_finished)
        busy += self.drain(p.evict_finished_inbox, p.on_evict)
        busy += self.drain(c.reg_send_inbox, c.on_item)
        busy += self.drain(p.deferred_push_inbox, p.on_deferred)
        busy += self._poll_notifs()
        busy += p.check_writes()
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
        elif self.producer.writing or self.producer.settling or self._hs_futures:
            wait = self._poll_s
        elif self.consumer.outstanding():
            # Inline, get_finished reads the lane every call: while only lane words are
            # awaited, notifications (a PUSH_FAIL, heartbeats) can wait for the slow poll.
            lanes = self.inline and self.consumer.only_lanes()
            wait = max(cfg.max_poll_interval_s, LANE_TICK_S) if lanes else self._poll_s
        else:
            wait, idle = cfg.idle_poll_s, True
        self._writer_idle = idle
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
            self.heard[sender] = now
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
        if sender in self.peers_by_agent or sender in self.authenticated:
            return True
        self.stats["notif_unauthenticated"] += 1
        n = self.stats["notif_unauthenticated"]
        if n <= 10 or n % 1000 == 0:
            log.warning("notification from unauthenticated agent %r dropped (#%d)", sender, n)
        return False

    def _dispatch(self, sender: str, msg: wire.Message) -> None:
        if isinstance(msg, wire.PushReg):
            self.producer.on_push_reg(sender, msg)
        elif isinstance(msg, wire.Completion | wire.StagedDone):
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
            "writing": len(self.producer.writing),
            "receiving": self.consumer.outstanding(),
            **{f"handshake_refused_{k}": v for k, v in self._server.refused.items()},
        }
