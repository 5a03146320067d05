"""The small transport interface the rest of kvpush talks to.

``nixl_transport.NixlTransport`` is the real one; ``memory_transport`` is an
in-process stand-in for deterministic unit tests of the state machines.
Descriptors are Nx3 rows of (address, length, device id): an int64 array, or a list of
tuples for a short push (``Rows``; building an array costs more than a few rows do).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import numpy as np

from kvpush.core.layout import KVLayout

Rows = np.ndarray | list[tuple[int, int, int]]


def rows_array(rows: Rows) -> np.ndarray:
    """Rows as an Nx3 int64 array (no copy if they are one)."""
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def row_bytes(rows: Rows) -> int:
    """The bytes that descriptor rows move."""
    if isinstance(rows, list):
        return sum(r[1] for r in rows)
    return int(rows[:, 1].sum()) if len(rows) else 0


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class Transport(ABC):
    """One agent: owns registered memory, peers, WRITEs and notifications.

    Not thread-safe: after ``register`` every call comes from the ticking thread (the
    engine's, or the keeper; the worker's lock makes it one at a time), except ``probe``.
    """

    agent_name: str

    @abstractmethod
    def register(self, layout: KVLayout) -> None:
        """Register the memory behind ``layout`` for remote WRITEs."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to ``add_peer`` to reach us."""

    @abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> None:
        """Make ``name`` reachable; replaces an older entry of the same name."""

    @abstractmethod
    def probe(self, metadata: bytes) -> None:
        """Connect to the agent ``metadata`` names and drop the connection again; raises
        TransportError if that fails. Called from handshake threads, so it must not touch
        this transport's own agent, and it may block as long as a connection attempt."""

    @abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (it died or restarted); unknown names are ignored."""

    @abstractmethod
    def write(self, peer: str, src: Rows, dst: Rows, notif: bytes) -> object:
        """Post one WRITE of src descriptors into the peer's dst; ``notif`` arrives after it."""

    @abstractmethod
    def check(self, handle: object) -> WriteState:
        """Progress and report a posted WRITE."""

    @abstractmethod
    def release(self, handle: object) -> None:
        """Free a WRITE handle once its outcome is known."""

    @abstractmethod
    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send a standalone notification."""

    @abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Drain received notifications as (sender agent name, bytes); also progresses."""

    @abstractmethod
    def close(self) -> None:
        """Release everything; the transport is unusable afterwards."""
