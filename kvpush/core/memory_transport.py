"""An in-process Transport for deterministic unit tests of the state machines.

Agents on one ``Fabric`` copy bytes with ctypes.memmove between registered
numpy buffers of the same process. Tests steer it: hold WRITEs pending, fail
them, drop notifications, or mark a peer dead.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvpush.core.errors import PeerGoneError, PeerUnknownError, TransportError
from kvpush.core.layout import KVLayout
from kvpush.core.transport import Rows, Transport, WriteState, rows_array


@dataclass(eq=False)  # a handle: compared by identity (its arrays cannot be compared by ==)
class _Write:
    target: str
    src: np.ndarray
    dst: np.ndarray
    notif: bytes
    sender: str
    state: WriteState = WriteState.PENDING


@dataclass
class Fabric:
    """Shared state of all in-memory agents; its lock makes cross-thread use safe."""

    agents: dict[str, MemoryTransport] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    hold_writes: bool = False  # WRITEs stay PENDING until complete_writes()
    fail_writes: bool = False
    drop: Callable[[str, str, bytes], bool] = lambda sender, target, msg: False
    # Called by every probe with the agent named (from handshake threads): tests make it
    # block, as a connection to an address that never answers does, or raise.
    probe: Callable[[str], None] = lambda agent: None
    lock: threading.RLock = field(default_factory=threading.RLock)
    writes: list[_Write] = field(default_factory=list)

    def complete_writes(self, ok: bool = True) -> None:
        with self.lock:
            for w in self.writes:
                if w.state is WriteState.PENDING:
                    self._finish(w, ok)

    def _finish(self, w: _Write, ok: bool) -> None:
        if not ok or w.target in self.dead:
            w.state = WriteState.ERROR
            return
        for (s, n, _), (d, _, _) in zip(w.src.tolist(), w.dst.tolist(), strict=True):
            ctypes.memmove(d, s, n)
        w.state = WriteState.DONE
        if w.notif:
            self.agents[w.target].deliver(w.sender, w.notif)


class MemoryTransport(Transport):
    def __init__(self, fabric: Fabric, agent_name: str) -> None:
        self.fabric = fabric
        self.agent_name = agent_name
        self._spans: list[tuple[int, int]] = []
        self._peers: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []
        with fabric.lock:
            fabric.agents[agent_name] = self

    def register(self, layout: KVLayout) -> None:
        self._spans += [(r.base_addr, r.base_addr + r.nbytes) for r in layout.regions]

    def metadata(self) -> bytes:
        return self.agent_name.encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        if metadata.decode() != name:
            raise TransportError(f"metadata names {metadata!r}, expected {name!r}")
        self._peers.add(name)

    def probe(self, metadata: bytes) -> None:
        self.fabric.probe(metadata.decode())  # (outside the lock: it may block)

    def remove_peer(self, name: str) -> None:
        with self.fabric.lock:
            self._peers.discard(name)
            for w in self.fabric.writes:  # a disconnect ends what was in flight to it
                if w.sender == self.agent_name and w.target == name:
                    if w.state is WriteState.PENDING:
                        w.state = WriteState.ERROR

    def _target(self, peer: str) -> MemoryTransport:
        if peer not in self._peers:
            raise PeerUnknownError(f"peer {peer} not added")
        if peer in self.fabric.dead or peer not in self.fabric.agents:
            raise PeerGoneError(f"peer {peer} is gone")
        return self.fabric.agents[peer]

    def covers(self, descs: np.ndarray) -> bool:
        return all(
            any(lo <= a and a + n <= hi for lo, hi in self._spans) for a, n, _ in descs.tolist()
        )

    def write(self, peer: str, src: Rows, dst: Rows, notif: bytes) -> object:
        src, dst = rows_array(src), rows_array(dst)
        with self.fabric.lock:
            target = self._target(peer)
            if not self.covers(src) or not target.covers(dst):
                raise PeerUnknownError("descriptor outside registered memory")
            w = _Write(peer, src.copy(), dst.copy(), notif, self.agent_name)
            self.fabric.writes.append(w)
            if not self.fabric.hold_writes:
                self.fabric._finish(w, not self.fabric.fail_writes)
            return w

    def check(self, handle: object) -> WriteState:
        assert isinstance(handle, _Write)
        return handle.state

    def release(self, handle: object) -> None:
        with self.fabric.lock:
            if handle in self.fabric.writes:
                self.fabric.writes.remove(handle)  # type: ignore[arg-type]

    def send_notif(self, peer: str, msg: bytes) -> None:
        with self.fabric.lock:
            self._target(peer).deliver(self.agent_name, msg)

    def deliver(self, sender: str, msg: bytes) -> None:
        with self.fabric.lock:
            if not self.fabric.drop(sender, self.agent_name, msg):
                self._inbox.append((sender, msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with self.fabric.lock:
            got, self._inbox = self._inbox, []
        return got

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.agents.pop(self.agent_name, None)
