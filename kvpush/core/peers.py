"""The peers a worker talks to: handshakes, what each peer told us, and when we last heard.

Owned by the thread that ticks (the engine's, or the keeper in its place); handshakes run
on a small pool and only call back (``ensure``'s ``replay``), the ticking thread then
finishes them (``load``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvpush.core.errors import HandshakeError, TransportError
from kvpush.core.handshake import AgentInfo, AgentSet
from kvpush.core.layout import KVLayout, RegionPair
from kvpush.core.peer_copy import PeerCopyHook
from kvpush.core.routing import pair_regions
from kvpush.core.transport import Transport
from kvpush.core.types import WorkerConfig

log = logging.getLogger(__name__)

PeerKey = tuple[str, int]
FAILED_KEPT = 1024  # failed agents remembered (PeerTable.failed)


@dataclass
class Peer:
    key: PeerKey
    info: AgentInfo
    copy_declined: bool = False  # our peer-copy hook cannot reach it (core/routes.py)
    pairs: list[RegionPair] | None = None  # our regions into the peer's, once computed
    # For the copy route, once: the pairs as block_pieces rows, its layout's group_limits.
    pieces: np.ndarray | None = None
    limits: list[int] | None = None
    writes_to_us: bool = False  # its layout was checked to write into ours

    @property
    def agent(self) -> str:
        return self.info.agent_name


class PeerTable:
    """Peers by side-channel address and by agent name."""

    def __init__(
        self,
        config: WorkerConfig,
        transport: Transport,
        layout: KVLayout,
        fetch: Callable[..., AgentInfo],
        agent: str,
        stats: Counter[str],
        wake: Callable[[], None],
        peer_copy: PeerCopyHook | None = None,
        host_id: str = "",
    ) -> None:
        self.config = config
        self.transport = transport
        self.layout = layout
        self._fetch = fetch  # tests substitute a gated or failing handshake
        self._agent = agent  # ours: the name the peer will hear us under
        self.stats = stats
        self._wake = wake
        self.peer_copy = peer_copy
        self.host_id = host_id  # ours (lane.host_identity), for the log
        self.by_key: dict[PeerKey, Peer] = {}
        self.by_agent: dict[str, Peer] = {}
        self.heard: dict[str, float] = {}  # agent -> when we last received anything from it
        # Known peers whose connection failed (a transport error), the latest FAILED_KEPT:
        # nothing more can arrive from them (consumer.py ends its holds on them).
        self.failed: OrderedDict[str, None] = OrderedDict()
        # With a secret: the agents that proved it to us, either way.
        self.authenticated = AgentSet()
        # Under way, or ended and not yet loaded; at most one per address.
        self.handshakes: dict[PeerKey, Future[AgentInfo]] = {}
        self._per_host = max(1, config.handshake_workers // 2)
        self._executor = ThreadPoolExecutor(config.handshake_workers, "kvpush-handshake")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def get(self, host: str, port: int) -> Peer | None:
        return self.by_key.get((host, port))

    def ensure(
        self, host: str, port: int, replay: Callable[[Future[AgentInfo]], None]
    ) -> Peer | None:
        """The ready peer, or None after arranging ``replay(future)`` once its handshake ends."""
        key = (host, port)
        peer = self.by_key.get(key)
        if peer is not None:
            return peer
        fut = self.handshakes.get(key)
        if fut is None:
            full = self._full(host)
            if full:  # costs the asker, at once; nothing is queued behind the busy ones
                self.stats["handshake_refused_busy"] += 1
                fut = Future()
                fut.set_exception(HandshakeError(f"handshake with {host}:{port} not tried: {full}"))
            else:
                fut = self._submit(host, port)

        def done(f: Future[AgentInfo]) -> None:
            replay(f)
            self._wake()

        fut.add_done_callback(done)
        return None

    def _submit(self, host: str, port: int) -> Future[AgentInfo]:
        """Start a handshake on the pool (on the ticking thread: nothing here waits)."""
        fut = self._executor.submit(self._handshake, host, port)
        self.handshakes[(host, port)] = fut
        self.stats["handshakes"] += 1
        return fut

    def _handshake(self, host: str, port: int) -> AgentInfo:
        """On a pool thread: the peer's agent info, then a trial connection to the NIXL
        address it names, so that ``load`` on the ticking thread never waits on a peer
        (NIXL connects inside add_remote_agent: 3 s where nobody answers ARP, over 2 min
        where the path drops packets)."""
        cfg = self.config
        info = self._fetch(
            host,
            port,
            cfg.engine_id,
            cfg.handshake_timeout_s,
            # (layouts are checked per direction: pairs_to / check_from)
            secret=cfg.shared_secret,
            agent=self._agent,
        )
        try:
            self.transport.probe(info.nixl_metadata)
        except TransportError as e:
            raise HandshakeError(
                f"{host}:{port} answered, but its NIXL agent {info.agent_name} "
                f"cannot be reached: {e}"
            ) from e
        return info

    def _full(self, host: str) -> str:
        """Why no new handshake can start now ("" when one can): every pool thread is
        taken, or half of them wait on one host. Linear in the handshakes under way."""
        running = [k for k, f in self.handshakes.items() if not f.done()]
        if len(running) >= self.config.handshake_workers:
            return f"{len(running)} handshakes under way (handshake_workers)"
        if sum(k[0] == host for k in running) >= self._per_host:
            return f"{self._per_host} handshakes with {host} under way"
        return ""

    def load(self, host: str, port: int, fut: Future[AgentInfo]) -> Peer:
        """Finish a handshake: raises HandshakeError or TransportError."""
        key = (host, port)
        if self.handshakes.get(key) is fut:
            del self.handshakes[key]
        peer = self.by_key.get(key)
        if peer is not None:
            return peer
        info = fut.result()
        self.authenticated.add(info.agent_name)  # it proved the secret, if we have one
        old = self.by_agent.get(info.agent_name)
        if old is not None:  # same agent reached under another address
            self.by_key[key] = old
            return old
        self.transport.add_peer(info.agent_name, info.nixl_metadata)
        self.failed.pop(info.agent_name, None)  # connected again
        peer = Peer(key, info)  # (a new Peer: its route is chosen afresh, core/routes.py)
        self.by_key[key] = peer
        self.by_agent[info.agent_name] = peer
        self.heard[info.agent_name] = time.monotonic()  # the handshake is a sign of life
        where = "same host" if info.host_id == self.host_id else "another host"
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

    def check_from(self, peer: Peer) -> None:
        """Raise LayoutError unless the peer can write into our layout (checked once)."""
        if not peer.writes_to_us:
            pair_regions(peer.info.layout, self.layout)
            peer.writes_to_us = True

    def forget(self, agent: str, failed: bool = False) -> None:
        """Drop a peer that died (``failed``: its connection failed) or fell silent; the
        next operation towards it handshakes afresh."""
        peer = self.by_agent.pop(agent, None)
        if peer is None:
            return  # (a failure towards an unknown agent says nothing of its connection)
        if failed:
            self.failed[agent] = None
            while len(self.failed) > FAILED_KEPT:
                self.failed.popitem(last=False)
        for key in [k for k, p in self.by_key.items() if p is peer]:
            del self.by_key[key]
        if self.peer_copy is not None:
            self.peer_copy.forget(agent)
        self.transport.remove_peer(agent)
        self.heard.pop(agent, None)
        log.info("peer %s forgotten", agent)
