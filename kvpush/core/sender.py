"""P's one path for a matched leg: post it on its route, then poll it to its end.

The sender alone calls a route (``arm``, ``launch``, ``post``, ``poll``), through its
chooser (core/routes.py: the same-host copy, the NIXL WRITE or its layer-wise form).
``arm`` prepares a registration's leg before P's blocks are ready; ``launch_armed``
posts it the moment they are. ``push`` takes a leg that waits (MATCHED, DEFERRED,
RECHECKING, SETTLING): it waits for the handshake with D if need be, then posts the leg
on its route. ``check`` posts the SETTLING legs whose blocks' device work ended and polls
the WRITING ones, ending each DONE or FAILED. The producer owns the legs; it learns of an
end through ``done`` and ``fail``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvpush.core import wire
from kvpush.core.errors import LayoutError, TransportError
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import Armed, Flight, PendingGroup, PushTransfer
from kvpush.core.route import settled
from kvpush.core.routes import Routes
from kvpush.core.transport import WriteState
from kvpush.core.types import ENDED, Poll, StagedBlocks, State, transition

log = logging.getLogger(__name__)

Replay = Callable[[PushTransfer, str, int], Callable[[Future[Any]], None]]


class Sender:
    def __init__(
        self,
        peers: PeerTable,
        stats: Counter[str],
        observe: Callable[[str, float], None],
        replay: Replay,
        done: Callable[[PushTransfer], None],
        fail: Callable[[PushTransfer, Peer | None, str], None],
    ) -> None:
        self.peers = peers
        self.routes = Routes(peers)
        self.stats = stats
        self.observe = observe
        self._replay = replay  # the callback that brings a leg back after its handshake
        self._done = done
        self._fail = fail
        # The legs ``check`` looks at (SETTLING, WRITING, CANCELLING), by id() of the leg.
        self.moving: dict[int, PushTransfer] = {}

    def busy(self) -> bool:
        return bool(self.moving)

    @property
    def writing(self) -> list[PushTransfer]:
        """The legs posted and not yet ended."""
        return [t for t in self.moving.values() if t.poll() is Poll.TRANSFERRING]

    def forget(self, t: PushTransfer) -> None:
        self.moving.pop(id(t), None)

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D registered before P's blocks are ready: what its route can prepare now."""
        return self.routes.arm(peer, reg, dst)

    def launch_armed(self, staged: StagedBlocks, group: PendingGroup) -> Flight | None:
        """Post the leg armed for a request's only registration before any of the
        producer's bookkeeping (the end of a prefill: latency counts); None when there is
        none or its route declines to (the full path then decides)."""
        regs = group.regs
        if len(regs) != 1:
            return None
        (pend,) = regs.values()
        if pend.armed is None:
            return None
        flight = self.routes.launch(pend, staged)
        if flight is not None:
            pend.armed = None
        return flight

    def push(self, t: PushTransfer) -> None:
        if t.state in ENDED:
            log.debug("transfer %s ended (%s) before its post; dropped", t.name, t.state.value)
            return
        reg = t.reg
        assert reg is not None
        if t.flight is not None:  # posted by launch_armed: its peer was checked there
            self._posted(t, t.flight)
            return
        host, port = reg.decode_host, reg.decode_port
        peer = self.peers.ensure(host, port, self._replay(t, host, port))
        if peer is None:
            if t.state not in (State.DEFERRED, State.RECHECKING):  # (waiting already)
                transition(t, State.DEFERRED, t.name, "waiting for handshake with D")
            return
        if peer.agent != t.sender:
            if t.state is not State.RECHECKING and t.sender not in self.peers.by_agent:
                # The decoder at that address may have restarted as a new agent: ask again.
                why = f"{host}:{port} is {peer.agent} now: handshake again"
                transition(t, State.RECHECKING, t.name, why)
                self.peers.forget(peer.agent)
                self.push(t)
                return
            self.stats["reg_wrong_sender"] += 1
            self._fail(t, peer, f"registration sent by {t.sender}, not by {peer.agent}")
            return
        route = self.routes.for_leg(t, peer)
        if route is None:
            self._fail(t, peer, "a layer-wise push on a route that takes whole requests")
            return
        try:
            flight = self.routes.post(route, t, peer)
        except (LayoutError, wire.WireError) as e:
            self.stats["reg_invalid"] += 1
            self._fail(t, peer, f"invalid registration: {e}")
            return
        except TransportError as e:
            self._fail(t, peer, str(e))
            return
        if flight is None:  # check posts it once the blocks' device work ended
            if t.state is not State.SETTLING:
                transition(t, State.SETTLING, t.name, "P's blocks still follow device work")
            self.moving[id(t)] = t
            return
        self._posted(t, flight)

    def _posted(self, t: PushTransfer, f: Flight) -> None:
        t.flight, f.name = f, t.name
        self.moving[id(t)] = t
        route = f.route
        self.stats[route.posts] += 1
        self.stats[route.units] += f.units
        self.stats["write_bytes"] += f.nbytes
        after = "P notifies D at its end" if f.notice is not None else "D is told at its end"
        transition(t, State.WRITING, t.name, f"{f.units} {route.units}; {after}")

    def check(self) -> int:
        """Post the legs whose blocks' device work ended; end the posted ones that are
        over. Returns how many changed."""
        changed = 0
        for t in [t for t in self.moving.values() if t.state is State.SETTLING]:
            if settled(t):
                del self.moving[id(t)]
                changed += 1
                self.push(t)
        for t in self.writing:
            f = t.flight
            assert f is not None
            state = f.route.poll(f)
            if state is WriteState.PENDING:
                continue
            changed += 1
            del self.moving[id(t)]
            f.route.release(f)
            t.flight = None
            if state is WriteState.DONE:
                transition(t, State.DONE, t.name)
                if t.preq is not None:  # from the blocks' hand-over to P seeing the end
                    self.observe("push_seconds", time.monotonic() - t.preq.since)
                self._done(t)
            else:
                self._fail(t, self.peers.by_agent.get(t.sender), f.error)
                if f.gone:
                    self.peers.forget(f.agent, failed=True)
        return changed
