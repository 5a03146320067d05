"""The same-host route: P copies straight into D's blocks through the peer-copy hook.

P's half (``CopyRoute``): armed when D registers (off the critical path), launched the
moment P's blocks are ready, polled to its end; without a lane word P then sends the
completion. D's half (``CopyReceiver``) alone knows the completion lane (core/lane.py):
a word for each same-host source that can copy, read back as that source's completion.
"""

from __future__ import annotations

import logging
from collections import Counter

import msgspec
import numpy as np

from kvpush.core import trace, wire
from kvpush.core.errors import LayoutError, PeerGoneError, TransportError
from kvpush.core.lane import CompletionLane
from kvpush.core.layout import group_limits
from kvpush.core.peer_copy import PeerCopyHook, Signal, copy_dst, copy_src, single_src
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import (
    Armed,
    Declined,
    Flight,
    PendingReg,
    PushTransfer,
    Route,
    source_blocks,
)
from kvpush.core.routing import block_pieces
from kvpush.core.transport import WriteState
from kvpush.core.types import StagedBlocks

log = logging.getLogger(__name__)


class CopyRoute(Route):
    posts, units = "copies", "copy_blocks"

    def __init__(self, hook: PeerCopyHook, peers: PeerTable) -> None:
        self.hook = hook
        self.peers = peers  # its transport (completions after a copy), config and stats
        self.limits = group_limits(peers.layout)  # ours: ids of group g lie below limits[g]
        self.stats = peers.stats

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        try:
            armed = self.prepare(peer, reg, dst)
        except (LayoutError, wire.WireError):
            return None  # the post meets it again and fails the leg with the reason
        self.stats["copy_armed"] += 1
        return armed

    def prepare(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed:
        """D's half of a copy, checked and handed to the hook. Raises Declined (the peer
        WRITEs from now on: core/routes.py), LayoutError for ids outside D's layout."""
        exported = peer.info.peer_copy
        assert exported is not None
        signal = None
        if isinstance(reg.lane, wire.LaneSlot) and peer.info.lane:
            signal = Signal(peer.info.lane, reg.lane.slot, reg.lane.gen)
        if peer.pieces is None or peer.limits is None:  # once per peer
            peer.limits = group_limits(peer.info.layout)
            peer.pieces = block_pieces(
                self.peers.layout, peer.info.layout, self.peers.pairs_to(peer)
            )
        cd = copy_dst(peer.limits, peer.pieces, dst, signal)
        try:
            handle = self.hook.prepare(peer.agent, exported, cd)
        except Exception as e:  # nothing was written: the WRITE still can be
            log.warning("direct copy to %s cannot be prepared (%s); writing instead", peer.agent, e)
            handle = None
        if handle is None:  # another host, no mapping, memory D did not export
            raise Declined(peer.agent)
        return Armed(self, peer.agent, cd, handle)

    def launch(
        self, armed: Armed, pend: PendingReg, staged: StagedBlocks, peer: Peer
    ) -> Flight | None:
        # Kept short: it runs on cold caches at the end of a prefill.
        reg = pend.reg
        assert armed.dst is not None
        try:
            limits, blocks = self.limits, staged.block_ids
            if armed.dst.single and len(blocks) == 1 and len(limits) == 1:
                one, nbytes = single_src(limits[0], armed.dst, blocks[0])
                ids, units = [one], len(one)
            else:
                ids, nbytes = copy_src(limits, armed.dst, source_blocks(pend.dst, blocks))
                units = sum(map(len, ids))
            signalled = self.hook.launch(armed.handle, ids, staged.after)
        except Exception:  # the full path meets it again and fails the leg with the reason
            return None
        self.stats["copy_early"] += 1
        if trace.ON:
            trace.mark("p_producer.launch", staged.transfer_id, staged.request_id)
        # With a lane word D learns of the end from the copy, else from P after it (notice).
        notice = None if signalled else reg.request_id
        return Flight(self, armed.handle, armed.agent, units, nbytes, notice)

    def post(self, t: PushTransfer, peer: Peer) -> Flight | None:
        assert t.reg is not None
        armed, t.armed = t.armed, None
        if armed is None or armed.agent != peer.agent or armed.route is not self:
            armed = self.prepare(peer, t.reg, t.dst)  # (Declined: routes.py WRITEs it)
        assert armed.dst is not None
        ids, nbytes = copy_src(self.limits, armed.dst, source_blocks(t.dst, t.blocks))
        try:
            signalled = self.hook.launch(armed.handle, ids, t.preq.after if t.preq else None)
        except Exception as e:  # could not start, or (waited for) failed
            self.stats["copy_failed"] += 1
            raise TransportError(f"direct copy failed: {e}") from e
        notice = None if signalled else t.reg.request_id
        return Flight(self, armed.handle, armed.agent, sum(map(len, ids)), nbytes, notice)

    def poll(self, f: Flight) -> WriteState:
        try:
            if not self.hook.finished(f.handle):
                return WriteState.PENDING
        except Exception as e:
            log.warning("direct copy %s: %s", f.name, e)
            self.stats["copy_failed"] += 1
            f.error = "direct copy failed"
            return WriteState.ERROR
        if f.notice is not None and not self._notify(f, f.notice):
            return WriteState.ERROR
        self.stats["copies_done"] += 1
        return WriteState.DONE

    def _notify(self, f: Flight, rid: str) -> bool:
        """A copy without a lane word is over: tell D (False, and why, if we cannot)."""
        peer = self.peers.by_agent.get(f.agent)
        try:
            if peer is None:
                raise TransportError(f"decoder {f.agent} is gone")
            notif = wire.encode_completion(rid, self.peers.config.tp_size)
            self.peers.transport.send_notif(peer.agent, notif)
        except (TransportError, wire.WireError) as e:
            self.stats["write_failed"] += 1
            if isinstance(e, PeerGoneError) and peer is not None:
                self.peers.forget(peer.agent)
            f.error = f"completion could not be sent: {e}"
            return False
        return True


class CopyReceiver:
    """D's half: lane words offered to same-host sources that copy, read as completions."""

    def __init__(self, slots: int, host_id: str, stats: Counter[str]) -> None:
        """``slots``: the lane's words (0: no lane, every completion comes over NIXL);
        ``host_id``: ours (lane.host_identity), words go only to sources on this host."""
        self._lane: CompletionLane | None = None
        if slots:
            try:
                self._lane = CompletionLane(slots)
            except OSError as e:  # no /dev/shm: completions keep going over NIXL
                log.warning("no completion lane (%s); copies notify over NIXL", e)
        self.name = self._lane.name if self._lane is not None else None  # AgentInfo.lane
        self.host_id = host_id
        self.stats = stats
        self._words: dict[str, dict[str, int]] = {}  # receive -> source -> slot awaited
        self._covered: set[str] = set()  # receives whose every source got a word

    @property
    def waiting(self) -> bool:
        """Some word is awaited (reading them is a memory read)."""
        return self._lane is not None and bool(self._lane.waiting)

    def covered(self) -> int:
        """How many receives end by their sources' words alone (no notification)."""
        return len(self._covered)

    def offer(self, rid: str, peer: Peer, msg: wire.PushReg) -> wire.PushReg:
        """``msg`` for a source of receive ``rid``: with a word of our lane if it can copy
        into us (same host, it exports peer-copy memory) and a word is free."""
        lane = self._lane
        if lane is None or peer.info.peer_copy is None:
            return msg
        if not peer.info.host_id or peer.info.host_id != self.host_id:
            return msg  # another host: it WRITEs and notifies over NIXL
        got = lane.reserve((rid, peer.agent))
        if got is None:
            self.stats["lane_full"] += 1
            return msg
        self._words.setdefault(rid, {})[peer.agent] = got[0]
        return msgspec.structs.replace(msg, lane=wire.LaneSlot(*got))

    def expect(self, rid: str, sources: int) -> None:
        """Receive ``rid``'s registration went out to its ``sources``."""
        if sources and len(self._words.get(rid, ())) == sources:
            self._covered.add(rid)

    def poll(self) -> list[tuple[str, str]]:
        """(receive, source) for each word written since the last poll: that source's
        copy is over, every byte in place."""
        lane = self._lane
        if lane is None or not lane.waiting:
            return []
        seen: list[tuple[str, str]] = lane.poll()  # (their slots are free again)
        self.stats["lane_done"] += len(seen)
        for rid, agent in seen:
            del self._words[rid][agent]
        return seen

    def release(self, rid: str) -> None:
        """Receive ``rid`` ended: its words still awaited are free again."""
        self._covered.discard(rid)
        words = self._words.pop(rid, None)
        if words and self._lane is not None:
            for slot in words.values():
                self._lane.release(slot)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
