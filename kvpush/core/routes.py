"""Which route a leg's bytes take: the sender's one way to its routes.

A peer takes the same-host copy (core/copy_route.py) when both sides have the peer-copy
hook, until the hook declines it: from then on the NIXL WRITE (core/route.py), that leg
included. A leg with a layer feed takes the layer route (core/layer_route.py), the
WRITE's layer-wise form. A forgotten peer is a new ``Peer`` when met again: chosen afresh.
"""

from __future__ import annotations

import numpy as np

from kvpush.core import wire
from kvpush.core.copy_route import CopyRoute
from kvpush.core.layer_route import LayerRoute
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import Armed, Declined, Flight, PendingReg, PushTransfer, Route
from kvpush.core.route import WriteRoute
from kvpush.core.types import StagedBlocks


class Routes:
    def __init__(self, peers: PeerTable) -> None:
        self.peers = peers
        self.write = WriteRoute(peers)
        self.layer = LayerRoute(peers)
        hook = peers.peer_copy
        self.copy = CopyRoute(hook, peers) if hook is not None else None

    def of(self, peer: Peer) -> Route:
        """The peer's route for whole requests."""
        copy = self.copy
        if copy is not None and peer.info.peer_copy is not None and not peer.copy_declined:
            return copy
        return self.write

    def for_leg(self, t: PushTransfer, peer: Peer) -> Route | None:
        """The leg's route; None for a layer-wise leg to a peer that takes whole requests
        (the worker makes feeds only without a peer-copy hook: never seen)."""
        route = self.of(peer)
        if t.preq is None or t.preq.feed is None:
            return route
        return self.layer if route is self.write else None

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        try:
            return self.of(peer).arm(peer, reg, dst)
        except Declined:
            self._decline(peer)
            return None

    def launch(self, pend: PendingReg, staged: StagedBlocks) -> Flight | None:
        """Post an armed registration's leg early, if its peer still takes the route that
        armed it; None: the full path decides."""
        armed, reg = pend.armed, pend.reg
        assert armed is not None
        peer = self.peers.get(reg.decode_host, reg.decode_port)
        if peer is None or peer.agent != armed.agent or self.of(peer) is not armed.route:
            return None
        return armed.route.launch(armed, pend, staged, peer)

    def post(self, route: Route, t: PushTransfer, peer: Peer) -> Flight | None:
        """``route.post``; a copy the hook declines goes on the WRITE route at once."""
        try:
            return route.post(t, peer)
        except Declined:
            self._decline(peer)
            return self.write.post(t, peer)

    def _decline(self, peer: Peer) -> None:
        # Another host, no mapping, memory D did not export: none of it changes while
        # this peer lives, so its later transfers go straight to the WRITE.
        peer.copy_declined = True
        self.peers.stats["copy_declined"] += 1
