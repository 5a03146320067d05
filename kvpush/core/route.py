"""How P's bytes reach one peer: its ``Route``, chosen when the handshake completes
(``PeerTable.load``): the same-host copy (core/copy_route.py) or the NIXL WRITE below.
The sender knows only this interface, called on the ticking thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvpush.core import layer_route, wire
from kvpush.core.errors import LayoutError, PeerGoneError, TransportError
from kvpush.core.layout import RegionPair, validate_block_ids
from kvpush.core.records import Armed, Flight, PendingReg, PushTransfer, source_blocks
from kvpush.core.routing import build_pair_descs
from kvpush.core.transport import Rows, WriteState, row_bytes
from kvpush.core.types import StagedBlocks

if TYPE_CHECKING:
    from kvpush.core.peers import Peer, PeerTable

log = logging.getLogger(__name__)


class Route:
    """P's way into one peer's blocks: ``arm`` when D registers, ``post`` the leg when P's
    blocks are ready, ``poll`` the ``Flight`` it got until it ends, then ``release`` it."""

    posts = units = ""  # counters: legs posted, and what they moved (descriptors, blocks)
    stopped_by_forget = False  # forgetting the peer ends a posted leg (in error)
    layered = False  # posts a request layer by layer as its forward writes them

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D registered before P's blocks are ready: prepare what can be (optional)."""
        return None

    def launch(self, armed: Armed, pend: PendingReg, staged: StagedBlocks) -> Flight | None:
        """Post an armed leg before the producer's bookkeeping (``Sender.launch_armed``);
        None when a check might fail: the leg then takes ``post``."""
        return None

    def post(self, t: PushTransfer, peer: Peer) -> Flight | None:
        """Start moving the leg's bytes; None: not yet, P's blocks still follow device work
        (``settled``; the sender asks again at each tick). Raises TransportError with the
        reason to fail the leg, LayoutError or WireError for an invalid registration."""
        raise NotImplementedError

    def poll(self, f: Flight) -> WriteState:
        """PENDING; DONE (D has been or will be told); ERROR (``f.error`` says why)."""
        raise NotImplementedError

    def release(self, f: Flight) -> None:
        """Free what a flight holds, once ``poll`` gave its outcome."""


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
    layered = True  # core/layer_route.py

    def __init__(self, peers: PeerTable) -> None:
        self.peers = peers  # its transport, our layout, config and stats

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D's ids checked, the region pairs found and the completion notice made while P
        still computes, so that the end of the prefill only builds descriptors and posts
        (``launch``)."""
        if peer.route is not self:
            return None
        try:
            pairs = self.peers.pairs_to(peer)
            validate_block_ids(peer.info.layout, dst, unique_known=True)
            notif = wire.encode_completion(reg.request_id, self.peers.config.tp_size)
        except (LayoutError, wire.WireError):
            return None  # the post meets it again and fails the leg with the reason
        return Armed(self, peer.agent, None, (pairs, notif))

    def launch(self, armed: Armed, pend: PendingReg, staged: StagedBlocks) -> Flight | None:
        # Kept short: it runs at the end of a prefill. Anything unusual takes ``post``.
        peer = self.peers.get(pend.reg.decode_host, pend.reg.decode_port)
        if peer is None or peer.agent != armed.agent or peer.route is not self:
            return None
        assert isinstance(armed.handle, tuple)
        pairs, notif = armed.handle
        try:
            if staged.after is not None and not staged.after.query():
                return None  # the blocks' writes still run: the leg waits in ``settling``
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
        if t.preq is not None and t.preq.feed is not None:  # layer by layer
            return layer_route.start(self, peers, t, peer)
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
        if isinstance(f.handle, layer_route.LayerWrites):
            return layer_route.advance(self.peers, f)
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
        if not isinstance(f.handle, layer_route.LayerWrites):  # (its WRITEs are released)
            self.peers.transport.release(f.handle)
