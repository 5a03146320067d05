"""Fault injection: a Transport wrapper around any Transport, steered by a fault plan.

A :class:`FaultPlan` is a list of :class:`Rule` s. Each rule names a point of the
protocol, an action and a filter (message kind, and a substring the message, the
WRITE's completion notification or the handshake's ``host:port`` must contain). The
first rule that matches and still has firings left acts:

=========  ==========================================================================
point      actions
=========  ==========================================================================
send       ``kill`` (SIGKILL this process before sending), ``drop``, ``fail``
           (raise PeerGoneError, as a dead peer does)
recv       ``kill`` (SIGKILL when ``get_notifs`` returns it), ``drop``, ``dup``,
           ``delay`` (by ``delay_s``), ``reorder`` (hold it until a later message of
           kind ``after_kind`` from the same sender is delivered, at most ``delay_s``)
write      ``kill`` (before posting), ``fail`` (post raises TransportError), ``error``
           (the WRITE ends in ERROR, nothing written), ``delay`` (post ``delay_s``
           late: the WRITE is in flight all that time), ``reset`` (raise PeerGoneError
           and fail the next handshake), ``gone`` (raise PeerGoneError: the connection
           broke while idle; the next handshake works)
posted     ``kill`` (right after the WRITE was posted)
handshake  ``fail`` (HandshakeError), ``delay`` (by ``delay_s``)
=========  ==========================================================================

Plans are plain picklable dataclasses, so a parent can hand one to a child process
(``SimSpec.faults``) or swap it at run time (``FaultInjector.set_plan``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush.core import wire
from kvpush.core.errors import HandshakeError, PeerGoneError, TransportError
from kvpush.core.layout import KVLayout
from kvpush.core.transport import Rows, Transport, WriteState

log = logging.getLogger(__name__)

KINDS = ("REG", "FAIL", "CANCEL", "HB", "COMPLETION")
ACTIONS: dict[str, frozenset[str]] = {
    "send": frozenset({"kill", "drop", "fail"}),
    "recv": frozenset({"kill", "drop", "dup", "delay", "reorder"}),
    "write": frozenset({"kill", "fail", "error", "delay", "reset", "gone"}),
    "posted": frozenset({"kill"}),
    "handshake": frozenset({"fail", "delay"}),
}
_PREFIX_KIND = {
    wire.REG_PREFIX: "REG",
    wire.FAIL_PREFIX: "FAIL",
    wire.CANCEL_PREFIX: "CANCEL",
    wire.HB_PREFIX: "HB",
}


def kind_of(msg: bytes) -> str:
    """The kind of a notification by its prefix; anything else counts as a completion."""
    for prefix, kind in _PREFIX_KIND.items():
        if msg.startswith(prefix):
            return kind
    return "COMPLETION"


@dataclass(frozen=True)
class Rule:
    point: str
    action: str
    kind: str = "*"  # message kind (send / recv points); "*" matches any
    match: str = ""  # substring of the message / notif / "host:port"; "" matches any
    times: int = 1  # firings before the rule is spent; 0 = unlimited
    prob: float = 1.0
    delay_s: float = 0.5
    after_kind: str = "*"  # reorder: the kind of message that must overtake

    def __post_init__(self) -> None:
        if self.action not in ACTIONS.get(self.point, frozenset()):
            raise ValueError(f"no action {self.action!r} at point {self.point!r}")
        for k in (self.kind, self.after_kind):
            if k != "*" and k not in KINDS:
                raise ValueError(f"unknown message kind {k!r}")
        if self.times < 0 or not 0.0 <= self.prob <= 1.0 or self.delay_s < 0:
            raise ValueError(f"bad rule parameters: {self}")


@dataclass
class FaultPlan:
    rules: list[Rule] = field(default_factory=list)
    seed: int = 0


def die() -> None:
    """SIGKILL this process at once: no cleanup, no flush, as a crash."""
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)  # not reached: SIGKILL cannot be caught


class FaultInjector:
    """Decides which rule fires; shared by the transport (the ticking thread) and handshakes."""

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self._lock = threading.Lock()
        self.fired: Counter[str] = Counter()
        self.handshake_failures_armed = 0
        self.set_plan(plan or FaultPlan())

    def set_plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self._rules = list(plan.rules)
            self._left = [r.times for r in plan.rules]
            self._rng = random.Random(plan.seed)

    def pick(self, point: str, kind: str, text: bytes) -> Rule | None:
        with self._lock:
            for i, r in enumerate(self._rules):
                if r.point != point or (r.kind != "*" and r.kind != kind):
                    continue
                if r.times and self._left[i] <= 0:
                    continue
                if r.match and r.match.encode() not in text:
                    continue
                if r.prob < 1.0 and self._rng.random() >= r.prob:
                    continue
                self._left[i] -= 1
                self.fired[f"{point}:{r.action}:{kind}"] += 1
                return r
        return None

    def arm_handshake_failure(self) -> None:
        with self._lock:
            self.handshake_failures_armed += 1

    def wrap_fetch(self, fetch: Callable[..., Any]) -> Callable[..., Any]:
        """A handshake fetch that fails or lags as the plan says."""

        def faulty(host: str, port: int, *args: Any, **kw: Any) -> Any:
            with self._lock:
                armed = self.handshake_failures_armed > 0
                if armed:
                    self.handshake_failures_armed -= 1
                    self.fired["handshake:fail:armed"] += 1
            if armed:
                raise HandshakeError(f"injected: handshake with {host}:{port} failed")
            rule = self.pick("handshake", "*", f"{host}:{port}".encode())
            if rule is not None and rule.action == "fail":
                raise HandshakeError(f"injected: handshake with {host}:{port} failed")
            if rule is not None and rule.action == "delay":
                time.sleep(rule.delay_s)  # emulates a slow peer on the handshake thread
            return fetch(host, port, *args, **kw)

        return faulty


class _FailedWrite:
    """A WRITE that ends in ERROR without touching the peer."""


class _DelayedWrite:
    """A WRITE posted ``delay`` seconds late; PENDING until then."""

    def __init__(self, post: Callable[[], object], due: float, notif: bytes) -> None:
        self.post = post
        self.due = due
        self.notif = notif
        self.real: object | None = None
        self.failed = False


class FaultTransport(Transport):
    """Wraps a Transport; injects the plan's faults. Used from the ticking thread only
    (the engine's or the keeper, under the worker's lock)."""

    def __init__(self, inner: Transport, injector: FaultInjector | None = None) -> None:
        self.inner = inner
        self.injector = injector or FaultInjector()
        self.agent_name = inner.agent_name
        self.calls: Counter[str] = Counter()  # write attempts, seen by the fuzzer
        self.write_notifs: deque[bytes] = deque(maxlen=16)  # of the latest write attempts
        self._delayed: list[tuple[float, str, bytes]] = []
        self._held: list[tuple[float, str, bytes, str]] = []  # reorder: deadline, sender, msg, kind

    # ---- plain delegation ----------------------------------------------------------------

    def register(self, layout: KVLayout) -> None:
        self.inner.register(layout)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, name: str, metadata: bytes) -> None:
        self.inner.add_peer(name, metadata)

    def probe(self, metadata: bytes) -> None:
        self.inner.probe(metadata)

    def remove_peer(self, name: str) -> None:
        self.inner.remove_peer(name)

    def close(self) -> None:
        self.inner.close()

    # ---- WRITEs --------------------------------------------------------------------------

    def write(self, peer: str, src: Rows, dst: Rows, notif: bytes) -> object:
        self.calls["write"] += 1
        return self._post(notif, lambda: self.inner.write(peer, src, dst, notif))

    def _post(self, notif: bytes, post: Callable[[], object]) -> object:
        self.write_notifs.append(notif)
        rule = self.injector.pick("write", "*", notif)
        if rule is None:
            return self._post_now(notif, post)
        if rule.action == "kill":
            die()
        if rule.action == "fail":
            raise TransportError("injected: WRITE could not be posted")
        if rule.action == "reset":
            self.injector.arm_handshake_failure()
            raise PeerGoneError("injected: peer connection reset")
        if rule.action == "gone":
            raise PeerGoneError("injected: the connection broke before the post")
        if rule.action == "error":
            return _FailedWrite()
        return _DelayedWrite(post, time.monotonic() + rule.delay_s, notif)

    def _post_now(self, notif: bytes, post: Callable[[], object]) -> object:
        handle = post()
        if self.injector.pick("posted", "*", notif) is not None:
            die()
        return handle

    def check(self, handle: object) -> WriteState:
        if isinstance(handle, _FailedWrite):
            return WriteState.ERROR
        if isinstance(handle, _DelayedWrite):
            if handle.failed:
                return WriteState.ERROR
            if handle.real is None:
                if time.monotonic() < handle.due:
                    return WriteState.PENDING
                try:
                    handle.real = self._post_now(handle.notif, handle.post)
                except TransportError as e:
                    log.warning("delayed WRITE could not be posted: %s", e)
                    handle.failed = True
                    return WriteState.ERROR
            return self.inner.check(handle.real)
        return self.inner.check(handle)

    def release(self, handle: object) -> None:
        if isinstance(handle, _FailedWrite):
            return
        if isinstance(handle, _DelayedWrite):
            if handle.real is not None:
                self.inner.release(handle.real)
            return
        self.inner.release(handle)

    # ---- notifications -------------------------------------------------------------------

    def send_notif(self, peer: str, msg: bytes) -> None:
        rule = self.injector.pick("send", kind_of(msg), msg)
        if rule is not None:
            if rule.action == "kill":
                die()
            if rule.action == "drop":
                return
            raise PeerGoneError(f"injected: notification to {peer} failed")
        self.inner.send_notif(peer, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self.calls["get_notifs"] += 1
        now = time.monotonic()
        out: list[tuple[str, bytes]] = []
        due = [(s, m) for t, s, m in self._delayed if t <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for sender, msg in self.inner.get_notifs():
            kind = kind_of(msg)
            rule = self.injector.pick("recv", kind, msg)
            if rule is None:
                out.append((sender, msg))
            elif rule.action == "kill":
                die()
            elif rule.action == "dup":
                out += [(sender, msg), (sender, msg)]
            elif rule.action == "delay":
                self._delayed.append((now + rule.delay_s, sender, msg))
            elif rule.action == "reorder":
                self._held.append((now + rule.delay_s, sender, msg, rule.after_kind))
            # "drop": nothing
        out += due  # late messages are not judged again
        return out + self._release_held(out, now)

    def _release_held(self, out: list[tuple[str, bytes]], now: float) -> list[tuple[str, bytes]]:
        """Held messages overtaken by a later one of the wanted kind (or held too long)."""
        released, kept = [], []
        for deadline, sender, msg, after in self._held:
            overtaken = any(s == sender and (after == "*" or kind_of(m) == after) for s, m in out)
            if overtaken or deadline <= now:
                released.append((sender, msg))
            else:
                kept.append((deadline, sender, msg, after))
        self._held = kept
        return released

    def pending_faults(self) -> int:
        """Messages still held back (delayed or reordered)."""
        return len(self._delayed) + len(self._held)
