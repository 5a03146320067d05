"""P's NIXL WRITEs of a leg pushed layer by layer (``PRequest.feed``, core/layers.py).

Such a leg takes this route where its peer's is the WRITE (core/routes.py): ``post``
makes its flight and posts every piece already written (a registration that came late
catches up), and each ``poll`` (at every tick) posts the pieces written since, in order,
then checks the WRITEs in flight. The leg stays WRITING until the feed is closed and
every posted WRITE is DONE; then P sends D the one completion notification a
whole-request WRITE carries, so D sees no difference. The first failed WRITE, a post
that fails, a feed the engine gave up, or D's cancel stops further posts; the leg then
ends (ERROR, one PUSH_FAIL) once the WRITEs already posted have ended, since until then
they may write D's blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from kvpush.core import trace, wire
from kvpush.core.errors import LayoutError, PeerGoneError, TransportError
from kvpush.core.layers import LayerFeed
from kvpush.core.layout import KVLayout, RegionPair
from kvpush.core.peers import Peer, PeerTable
from kvpush.core.records import Flight, PushTransfer, Route
from kvpush.core.routing import build_pair_descs
from kvpush.core.transport import WriteState, row_bytes
from kvpush.core.types import State

log = logging.getLogger(__name__)


@dataclass
class LayerWrites:
    """A layer-wise leg's flight handle: what it posted, what is still in flight."""

    feed: LayerFeed
    leg: PushTransfer
    d_layout: KVLayout
    by_layer: dict[str, list[RegionPair]] | None  # None: a region holds several layers
    pairs: list[RegionPair]
    skip: list[int]  # per group: P's blocks before D's first (D holds that prefix)
    posted: int = 0  # pieces posted (or skipped: nothing of ours for them)
    handles: list[object] = field(default_factory=list)
    error: str = ""


class LayerRoute(Route):
    """The WRITE route's form for a leg with a feed: a WRITE per written layer."""

    posts, units = "writes", "write_descs"
    stopped_by_forget = True  # NIXL ends a removed peer's WRITEs in error

    def __init__(self, peers: PeerTable) -> None:
        self.peers = peers  # its transport, our layout, config and stats

    def post(self, t: PushTransfer, peer: Peer) -> Flight:
        """The leg's flight, with every piece written so far posted. Raises LayoutError or
        WireError for an invalid registration, TransportError when a post fails."""
        assert t.preq is not None and t.preq.feed is not None and t.reg is not None
        peers, feed = self.peers, t.preq.feed
        pairs = peers.pairs_to(peer)
        if len(t.dst) != len(feed.total):
            raise LayoutError(f"{len(t.dst)} block groups, P holds {len(feed.total)}")
        skip = []
        for g, (d_ids, n) in enumerate(zip(t.dst, feed.total, strict=True)):
            if len(d_ids) > n:
                raise LayoutError(f"group {g}: D registered {len(d_ids)} blocks, P holds {n}")
            skip.append(n - len(d_ids))
        by_layer: dict[str, list[RegionPair]] | None = {}
        for pair in pairs:
            region = peers.layout.regions[pair.src]
            if len(region.members) != 1 or by_layer is None:
                by_layer = None  # a WRITE would carry layers not written yet: whole at the end
                continue
            by_layer.setdefault(region.members[0], []).append(pair)
        lw = LayerWrites(feed, t, peer.info.layout, by_layer, pairs, skip)
        f = Flight(self, lw, peer.agent, 0, 0, notice=t.reg.request_id)
        _post_ready(peers, f, lw)  # a failure here ends the leg at its first poll
        return f

    def poll(self, f: Flight) -> WriteState:
        """Post what became ready, check what is in flight."""
        peers, lw = self.peers, f.handle
        assert isinstance(lw, LayerWrites)
        cancelled = lw.leg.state is State.CANCELLING
        if not lw.error and not cancelled:
            _post_ready(peers, f, lw)
        _check(peers, f, lw)
        if lw.handles:
            return WriteState.PENDING
        feed = lw.feed
        complete = feed.closed and not feed.failed and lw.posted == len(feed.pieces)
        if lw.error or (cancelled and not complete):
            f.error = lw.error or "cancelled"
            return WriteState.ERROR
        if not complete:
            return WriteState.PENDING
        assert lw.leg.reg is not None
        notif = wire.encode_completion(lw.leg.reg.request_id, peers.config.tp_size)
        try:
            peers.transport.send_notif(f.agent, notif)
        except TransportError as e:
            f.error = f"completion could not be sent: {e}"
            return WriteState.ERROR
        peers.stats["writes_done"] += 1
        if trace.ON:
            trace.mark("p_layer.completion", lw.leg.tid, lw.leg.prid, lw.posted)
        return WriteState.DONE

    def release(self, f: Flight) -> None:
        """Nothing: each of its WRITEs is released as it ends."""


def _post_ready(peers: PeerTable, f: Flight, lw: LayerWrites) -> None:
    feed = lw.feed
    closed = feed.closed  # before the pieces: a closed feed gets no more
    pieces = feed.pieces
    if feed.failed:
        lw.error = f"prefill blocks given up: {feed.failed}"
        return
    if lw.by_layer is None:  # whole, once every layer is written
        if closed and lw.posted < len(pieces) and all(p.ready() for p in pieces):
            lw.posted = len(pieces)
            _write(peers, f, lw, lw.pairs, feed.blocks(), [0] * len(feed.total))
        return
    while lw.posted < len(pieces) and not lw.error:
        piece = pieces[lw.posted]
        if not piece.ready():
            return  # in order: a later layer waits for this one's device work
        lw.posted += 1
        pairs = lw.by_layer.get(piece.layer)
        if pairs:
            _write(peers, f, lw, pairs, piece.ids, piece.first)
            if trace.ON:
                trace.mark("p_layer.write", lw.leg.tid, lw.leg.prid, lw.posted)


def _write(
    peers: PeerTable,
    f: Flight,
    lw: LayerWrites,
    pairs: list[RegionPair],
    ids: list[list[int]],
    first: list[int],
) -> None:
    """Post one WRITE of ``pairs`` for P's blocks ``ids`` (block ``first[g]`` onwards of
    group g); no notification: the leg's completion follows its last WRITE."""
    src_ids: list[list[int]] = []
    dst_ids: list[np.ndarray] = []
    for g, (g_ids, at) in enumerate(zip(ids, first, strict=True)):
        cut = max(0, lw.skip[g] - at)  # blocks D already holds
        src_ids.append(g_ids[cut:])
        d_at = at + cut - lw.skip[g]
        dst_ids.append(lw.leg.dst[g][d_at : d_at + len(g_ids) - cut])
    if not any(len(g) for g in src_ids):
        return
    try:
        src, dst = build_pair_descs(peers.layout, lw.d_layout, pairs, src_ids, dst_ids, True)
        handle = peers.transport.write(f.agent, src, dst, b"")
    except (LayoutError, wire.WireError) as e:
        lw.error = f"invalid registration: {e}"
        return
    except TransportError as e:
        peers.stats["write_failed"] += 1
        if isinstance(e, PeerGoneError):
            peers.forget(f.agent)
        lw.error = f"WRITE could not be posted: {e}"
        return
    lw.handles.append(handle)
    nbytes = row_bytes(src)
    peers.stats["layer_writes"] += 1
    peers.stats["write_descs"] += len(src)
    peers.stats["write_bytes"] += nbytes


def _check(peers: PeerTable, f: Flight, lw: LayerWrites) -> None:
    for h in list(lw.handles):
        try:
            state = peers.transport.check(h)
        except TransportError as e:
            log.warning("layer write of %s: %s", lw.leg.name, e)
            state = WriteState.ERROR
            f.gone = f.gone or isinstance(e, PeerGoneError)
        if state is WriteState.PENDING:
            continue
        lw.handles.remove(h)
        try:
            peers.transport.release(h)
        except TransportError as e:
            log.debug("release of a layer write of %s: %s", lw.leg.name, e)
        if state is WriteState.ERROR and not lw.error:
            peers.stats["write_failed"] += 1
            lw.error = "WRITE failed"
