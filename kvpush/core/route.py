"""The NIXL WRITE route (``WriteRoute``), and ``settled``: whether the device work P's
blocks follow is done. Which route a leg takes is core/routes.py's to say.
"""

from __future__ import annotations

import logging

import numpy as np

from kvpush.core import wire
from kvpush.core.errors import LayoutError, PeerGoneError, TransportError
from kvpush.core.layout import RegionPair, validate_block_ids
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import Armed, Flight, PendingReg, PushTransfer, Route, source_blocks
from kvpush.core.routing import build_pair_descs
from kvpush.core.transport import Rows, WriteState, row_bytes
from kvpush.core.types import StagedBlocks

log = logging.getLogger(__name__)


def settled(t: PushTransfer) -> bool:
    """True once the device work P's blocks follow (``StagedBlocks.after``) is done:
    asked by query, never waited for (this may be the engine's thread)."""
    preq = t.preq
    if preq is None or preq.after is None:
        return True
    if not preq.after.query():
        return False
    preq.after = None
    return True


class WriteRoute(Route):
    """A NIXL WRITE whose completion notification NIXL delivers after its bytes."""

    posts, units = "writes", "write_descs"
    stopped_by_forget = True  # NIXL ends a removed peer's WRITEs in error

    def __init__(self, peers: PeerTable) -> None:
        self.peers = peers  # its transport, our layout, config and stats

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D's ids checked, the region pairs found and the completion notice made while P
        still computes, so that the end of the prefill only builds descriptors and posts
        (``launch``)."""
        try:
            pairs = self.peers.pairs_to(peer)
            validate_block_ids(peer.info.layout, dst, unique_known=True)
            notif = wire.encode_completion(reg.request_id, self.peers.config.tp_size)
        except (LayoutError, wire.WireError):
            return None  # the post meets it again and fails the leg with the reason
        return Armed(self, peer.agent, None, (pairs, notif))

    def launch(
        self, armed: Armed, pend: PendingReg, staged: StagedBlocks, peer: Peer
    ) -> Flight | None:
        # Kept short: it runs at the end of a prefill. Anything unusual takes ``post``.
        assert isinstance(armed.handle, tuple)
        pairs, notif = armed.handle
        try:
            if staged.after is not None and not staged.after.query():
                return None  # the blocks' writes still run: the leg waits SETTLING
            src_groups = source_blocks(pend.dst, staged.block_ids)
            src, dst = self._descs(peer, pairs, src_groups, pend.dst, True)
            handle = self.peers.transport.write(peer.agent, src, dst, notif)
        except Exception:  # nothing was posted: the full path meets it again, with the reason
            return None
        self.peers.stats["write_early"] += 1
        return self._flight(peer, handle, src)

    def post(self, t: PushTransfer, peer: Peer) -> Flight | None:
        assert t.reg is not None
        peers = self.peers
        src_groups = source_blocks(t.dst, t.blocks)
        if not settled(t):  # NIXL reads the bytes as they are
            return None
        src, dst = self._descs(peer, peers.pairs_to(peer), src_groups, t.dst, False)
        notif = wire.encode_completion(t.reg.request_id, peers.config.tp_size)
        try:
            handle = peers.transport.write(peer.agent, src, dst, notif)
        except TransportError as e:
            peers.stats["write_failed"] += 1
            if isinstance(e, PeerGoneError):
                peers.forget(peer.agent)
            raise TransportError(f"WRITE could not be posted: {e}") from e
        return self._flight(peer, handle, src)

    def _descs(
        self,
        peer: Peer,
        pairs: list[RegionPair],
        src_groups: list[list[int]],
        dst_groups: list[np.ndarray],
        dst_checked: bool,
    ) -> tuple[Rows, Rows]:
        p, d = self.peers.layout, peer.info.layout
        return build_pair_descs(p, d, pairs, src_groups, dst_groups, True, dst_checked)

    def _flight(self, peer: Peer, handle: object, src: Rows) -> Flight:
        return Flight(self, handle, peer.agent, len(src), row_bytes(src))

    def poll(self, f: Flight) -> WriteState:
        try:
            state = self.peers.transport.check(f.handle)
        except TransportError as e:
            log.warning("write %s: %s", f.name, e)
            state = WriteState.ERROR
            f.gone = isinstance(e, PeerGoneError)
        if state is WriteState.DONE:
            self.peers.stats["writes_done"] += 1
        elif state is WriteState.ERROR:
            self.peers.stats["write_failed"] += 1
            f.error = "WRITE failed"
        return state

    def release(self, f: Flight) -> None:
        self.peers.transport.release(f.handle)
