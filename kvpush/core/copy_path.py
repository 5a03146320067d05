"""P's same-host copy through the peer-copy hook (core/peer_copy.py), for the sender.

Armed when D registers (off the critical path: D's ids checked and the hook's kernel
table built), launched the moment P's blocks are ready, then polled to its end. A peer
the hook cannot reach is declined once and from then on gets NIXL WRITEs.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np

from kvpush.core import trace, wire
from kvpush.core.errors import LayoutError
from kvpush.core.peer_copy import PeerCopyHook, Signal, copy_dst, copy_src, single_src
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import Armed, Launched, PendingGroup, source_blocks
from kvpush.core.transport import WriteState
from kvpush.core.types import StagedBlocks

log = logging.getLogger(__name__)


class CopyPath:
    def __init__(
        self, hook: PeerCopyHook | None, peers: PeerTable, limits: list[int], stats: Counter[str]
    ) -> None:
        self.hook = hook
        self.peers = peers
        self.limits = limits  # ours: ids of group g lie below limits[g]
        self.stats = stats

    def usable(self, peer: Peer) -> bool:
        return self.hook is not None and peer.info.peer_copy is not None and not peer.copy_declined

    def arm(self, sender: str, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """Prepare the copy now, while P's blocks are not ready; None when D is not
        connected yet or cannot be copied into. The caller checked that this rank feeds
        that D rank."""
        peer = self.peers.get(reg.decode_host, reg.decode_port)
        if peer is None or peer.agent != sender or not self.usable(peer):
            return None
        try:
            armed = self.prepare(peer, reg, dst)
            self.stats["copy_armed"] += armed is not None
            return armed
        except (LayoutError, wire.WireError):
            return None  # the push meets it again and fails the transfer with the reason

    def prepare(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D's half of a copy, checked and handed to the hook; None: WRITE instead.
        Raises LayoutError for ids outside D's layout."""
        hook, exported = self.hook, peer.info.peer_copy
        assert hook is not None and exported is not None
        signal = None
        if isinstance(reg.lane, wire.LaneSlot) and peer.info.lane:
            signal = Signal(peer.info.lane, reg.lane.slot, reg.lane.gen)
        cd = copy_dst(self.peers.limits_of(peer), self.peers.pieces_to(peer), dst, signal)
        try:
            handle = hook.prepare(peer.agent, exported, cd)
        except Exception as e:  # nothing was written: the WRITE still can be
            log.warning("direct copy to %s cannot be prepared (%s); writing instead", peer.agent, e)
            handle = None
        if handle is None:
            # Another host, no mapping, memory D did not export: none of it changes
            # while this peer lives, so later transfers go straight to the WRITE.
            peer.copy_declined = True
            self.stats["copy_declined"] += 1
            return None
        return Armed(peer.agent, cd, handle)

    def launch_armed(self, staged: StagedBlocks, group: PendingGroup) -> Launched | None:
        """Launch the copy prepared for a request's only registration, before any of the
        producer's bookkeeping; None when any of its checks might not pass (they then run
        in full and decide). Kept short: it runs on cold caches at the end of a prefill."""
        regs = group.regs
        if len(regs) != 1:
            return None
        (pend,) = regs.values()
        armed, reg = pend.armed, pend.reg
        if armed is None or self.hook is None:
            return None
        peer = self.peers.get(reg.decode_host, reg.decode_port)
        if peer is None or peer.agent != armed.agent or peer.copy_declined:
            return None
        try:
            limits, blocks = self.limits, staged.block_ids
            if armed.dst.single and len(blocks) == 1 and len(limits) == 1:
                one, nbytes = single_src(limits[0], armed.dst, blocks[0])
                ids = [one]
            else:
                ids, nbytes = copy_src(limits, armed.dst, source_blocks(pend.dst, blocks))
            signalled = self.hook.launch(armed.handle, ids, staged.after)
        except Exception:  # the full path meets it again and fails the leg with the reason
            return None
        pend.armed = None
        self.stats["copy_early"] += 1
        if trace.ON:
            trace.mark("p_producer.launch", staged.transfer_id, staged.request_id)
        return Launched(armed, ids, nbytes, signalled)

    def launch(self, armed: Armed, ids: list[Any], after: Any) -> bool:
        """Launch a prepared copy of P's ``ids`` (``copy_src``'s); True when the copy
        itself tells D of its end (a lane word). Raises what the hook raises."""
        assert self.hook is not None
        return self.hook.launch(armed.handle, ids, after)

    def state(self, handle: object, name: str) -> WriteState:
        assert self.hook is not None
        try:
            return WriteState.DONE if self.hook.finished(handle) else WriteState.PENDING
        except Exception as e:
            log.warning("direct copy %s: %s", name, e)
            return WriteState.ERROR
