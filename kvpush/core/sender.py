"""P's one path for a matched leg: post it (a copy or a NIXL WRITE), then poll it to its end.

``push`` takes a MATCHED (or DEFERRED) leg: it waits for the handshake with D if need
be, then launches the same-host copy when the copy path can reach D, else posts a WRITE
once the blocks' device work is done. ``check`` polls what is in flight and ends each
leg DONE or FAILED. The producer owns the legs; it learns of an end through ``done`` and
``fail``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvpush.core import wire
from kvpush.core.copy_path import CopyPath
from kvpush.core.errors import LayoutError, PeerGoneError, TransportError
from kvpush.core.layout import KVLayout
from kvpush.core.peer_copy import copy_src
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import Armed, PushTransfer, source_blocks
from kvpush.core.routing import build_pair_descs
from kvpush.core.transport import Transport, WriteState
from kvpush.core.types import ENDED, State, transition

log = logging.getLogger(__name__)

Replay = Callable[[PushTransfer, str, int], Callable[[Future[Any]], None]]


class Sender:
    def __init__(
        self,
        peers: PeerTable,
        transport: Transport,
        copy: CopyPath,
        layout: KVLayout,
        tp_size: int,
        stats: Counter[str],
        observe: Callable[[str, float], None],
        replay: Replay,
        done: Callable[[PushTransfer], None],
        fail: Callable[[PushTransfer, Peer | None, str], None],
    ) -> None:
        self.peers = peers
        self.transport = transport
        self.copy = copy
        self.layout = layout
        self.tp_size = tp_size  # ours: D counts one completion per P rank
        self.stats = stats
        self.observe = observe
        self._replay = replay  # the callback that brings a leg back after its handshake
        self._done = done
        self._fail = fail
        self.writing: dict[int, PushTransfer] = {}  # by id() of the leg
        self.settling: dict[int, PushTransfer] = {}  # WRITEs waiting for their blocks' event

    def busy(self) -> bool:
        return bool(self.writing or self.settling)

    def forget(self, t: PushTransfer) -> None:
        self.writing.pop(id(t), None)

    def push(self, t: PushTransfer) -> None:
        if t.state in ENDED:
            log.debug("transfer %s ended (%s) before its WRITE; dropped", t.name, t.state.value)
            return
        reg = t.reg
        assert reg is not None
        if t.early is not None:  # launched by CopyPath.launch_armed: its peer was checked there
            e, t.early = t.early, None
            self._copied(t, e.armed.handle, e.ids, e.nbytes, e.signalled)
            return
        host, port = reg.decode_host, reg.decode_port
        peer = self.peers.ensure(host, port, self._replay(t, host, port))
        if peer is None:
            transition(t, State.DEFERRED, t.name, "waiting for handshake with D")
            return
        if peer.agent != t.sender:
            if not t.rechecked and t.sender not in self.peers.by_agent:
                # The decoder at that address may have restarted as a new agent: ask again.
                t.rechecked = True
                self.peers.forget(peer.agent)
                self.push(t)
                return
            self.stats["reg_wrong_sender"] += 1
            self._fail(t, peer, f"registration sent by {t.sender}, not by {peer.agent}")
            return
        try:
            src_groups = source_blocks(t.dst, t.blocks)
            armed, t.armed = t.armed, None
            if self.copy.usable(peer):
                if armed is None or armed.agent != peer.agent:
                    armed = self.copy.prepare(peer, reg, t.dst)
                if armed is not None:
                    ids, nbytes = copy_src(self.copy.limits, armed.dst, src_groups)
                    self._copy(t, peer, armed, ids, nbytes)
                    return
            if not self._settled(t):  # NIXL reads the bytes as they are
                self.settling[id(t)] = t  # check posts it once the event is done
                return
            pairs = self.peers.pairs_to(peer)
            src, dst = build_pair_descs(
                self.layout, peer.info.layout, pairs, src_groups, t.dst, dst_unique=True
            )
        except (LayoutError, wire.WireError) as e:
            self.stats["reg_invalid"] += 1
            self._fail(t, peer, f"invalid registration: {e}")
            return
        notif = wire.encode_completion(reg.request_id, self.tp_size)
        try:
            t.handle = self.transport.write(peer.agent, src, dst, notif)
        except TransportError as e:
            self.stats["write_failed"] += 1
            if isinstance(e, PeerGoneError):
                self.peers.forget(peer.agent)
            self._fail(t, peer, f"WRITE could not be posted: {e}")
            return
        self.writing[id(t)] = t
        self.stats["writes"] += 1
        self.stats["write_descs"] += len(src)
        if len(src):
            self.stats["write_bytes"] += int(src[:, 1].sum())
        transition(t, State.WRITING, t.name, f"{len(src)} descriptors")

    def _copy(self, t: PushTransfer, peer: Peer, armed: Armed, ids: list[Any], nbytes: int) -> None:
        """Launch the copy; with a lane word D learns of its end from the copy itself,
        otherwise P sends the completion once it is over."""
        try:
            signalled = self.copy.launch(armed, ids, t.preq.after if t.preq else None)
        except Exception as e:  # could not start, or (waited for) failed
            self.stats["copy_failed"] += 1
            self._fail(t, peer, f"direct copy failed: {e}")
            return
        self._copied(t, armed.handle, ids, nbytes, signalled)

    def _copied(
        self, t: PushTransfer, handle: object, ids: list[Any], nbytes: int, signalled: bool
    ) -> None:
        """A launched copy: polled until over (lane word or stream); then, without a lane
        word, P sends the completion (_notify_copied)."""
        self.stats["copies"] += 1
        self.stats["copy_blocks"] += sum(len(g) for g in ids)
        self.stats["write_bytes"] += nbytes
        t.copy, t.notify = handle, not signalled
        self.writing[id(t)] = t
        why = "it reports its end to D" if signalled else "P notifies D at its end"
        transition(t, State.WRITING, t.name, f"copy launched; {why}")

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

    def check(self) -> int:
        """Post the WRITEs whose blocks' device work ended; end the WRITEs and launched
        copies that are over. Returns how many changed."""
        changed = 0
        for key, t in list(self.settling.items()):
            if t.state in ENDED or self._settled(t):
                del self.settling[key]
                changed += 1
                self.push(t)  # (drops it if it ended meanwhile)
        for t in list(self.writing.values()):
            copy = t.copy is not None
            state = self.copy.state(t.copy, t.name) if copy else self._write_state(t)
            if state is WriteState.PENDING:
                continue
            changed += 1
            del self.writing[id(t)]
            t.copy = None
            if state is WriteState.DONE and t.notify and not self._notify_copied(t):
                continue
            if state is WriteState.DONE:
                transition(t, State.DONE, t.name)
                self.stats["copies_done" if copy else "writes_done"] += 1
                if t.preq is not None:  # from the blocks' hand-over to P seeing the end
                    self.observe("push_seconds", time.monotonic() - t.preq.since)
                self._done(t)
            else:
                self.stats["copy_failed" if copy else "write_failed"] += 1
                peer = self.peers.by_agent.get(t.sender)
                self._fail(t, peer, "direct copy failed" if copy else "WRITE failed")
        return changed

    def _write_state(self, t: PushTransfer) -> WriteState:
        try:
            state = self.transport.check(t.handle)
        except TransportError as e:
            log.warning("write %s: %s", t.name, e)
            state = WriteState.ERROR
        if state is not WriteState.PENDING:
            self.transport.release(t.handle)
            t.handle = None
        return state

    def _notify_copied(self, t: PushTransfer) -> bool:
        """A copy without a lane word is over: tell D (False, and failed, if we cannot)."""
        assert t.reg is not None
        peer = self.peers.by_agent.get(t.sender)
        notif = wire.encode_completion(t.reg.request_id, self.tp_size)
        try:
            if peer is None:
                raise TransportError(f"decoder {t.sender} is gone")
            self.transport.send_notif(peer.agent, notif)
        except TransportError as e:
            self.stats["write_failed"] += 1
            if isinstance(e, PeerGoneError) and peer is not None:
                self.peers.forget(peer.agent)
            self._fail(t, peer, f"completion could not be sent: {e}")
            return False
        return True
