"""The layer-wise push (core/layers.py, core/layer_route.py) between two simulated
engines on the in-memory transport: layers land on D as P's forward writes them, D
completes once, late registrations catch up, chunks carry their blocks, and failures,
cancels and given-up prompts end the push once, after the WRITEs already posted."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpush.core.layers import LayerFeed, Piece
from kvpush.core.types import StagedBlocks, State
from kvpush_bench.sim.engine import content_key
from tests.unit.test_push_states import Pair, recv_ok

RID, TID, DRID = "p1", "t1", "d1"


def hand_over(pair: Pair, n: int, total: int | None = None) -> tuple[list[int], LayerFeed]:
    """P's prefill of ``n`` blocks starts: its blocks are handed over with an empty feed
    (as the vLLM connector does before the forward)."""
    p = pair.p
    blocks = p._alloc(n)
    assert blocks is not None
    p.mem.fill(content_key(RID, TID), blocks)
    p.p_reqs[RID] = blocks
    assert p.sched.hand_over(RID, [blocks], TID, layered=True)
    feed = LayerFeed([total or n])
    p.worker.hand_over([StagedBlocks(RID, [blocks], TID, feed=feed)])
    return blocks, feed


def registered_then_handed_over(
    pair: Pair, d_blocks: int, p_blocks: int
) -> tuple[list[int], LayerFeed]:
    """D registers ``d_blocks`` blocks first, then P's prefill of ``p_blocks`` starts."""
    pair.register(DRID, TID, d_blocks)
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1)
    return hand_over(pair, p_blocks)


def names(pair: Pair) -> list[str]:
    return [r.name for r in pair.p.mem.layout.regions]


def landed(pair: Pair, region: int, p_ids: list[int], d_ids: list[int]) -> bool:
    """D's blocks ``d_ids`` of one region hold P's ``p_ids``."""
    return bool(np.array_equal(pair.p.mem.arrays[region][p_ids], pair.d.mem.arrays[region][d_ids]))


def d_blocks(pair: Pair) -> list[int]:
    return pair.d.d_reqs[DRID][0]


def stats(pair: Pair) -> dict[str, int]:
    return dict(pair.p.worker.stats)


def test_layers_land_as_written_and_d_completes_once_after_the_last(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    blocks, feed = registered_then_handed_over(pair, 4, 4)
    layers = names(pair)
    dst = d_blocks(pair)
    for i, name in enumerate(layers):
        feed.add(Piece(name, [blocks], [0]))
        pair.until(lambda i=i: landed(pair, i, blocks, dst), what=f"layer {name} on D")
        # The layers not written yet have not moved, and D is not told before the last.
        assert all(not pair.d.mem.arrays[j][dst].any() for j in range(i + 1, len(layers)))
        assert "recv" not in pair.d_kinds(DRID)
    for _ in range(5):
        pair.step()
    assert "recv" not in pair.d_kinds(DRID)  # every layer is there, but the feed is open
    feed.close()
    pair.until(lambda: recv_ok(pair, DRID), what="verified receive")
    assert pair.d_kinds(DRID) == ["recv"]
    assert stats(pair)["layer_writes"] == len(layers) and stats(pair)["writes_done"] == 1
    pair.p.finish(RID)
    pair.until(lambda: "sent" in pair.p_kinds(RID), what="finished_sending on P")
    pair.settle()


def test_a_late_registration_catches_up_then_follows(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    blocks, feed = hand_over(pair, 3)
    layers = names(pair)
    for name in layers[:5]:
        feed.add(Piece(name, [blocks], [0]))
    for _ in range(5):
        pair.step()
    assert stats(pair).get("layer_writes", 0) == 0  # no registration: nothing to write to
    pair.register(DRID, TID, 3)
    pair.until(lambda: stats(pair).get("layer_writes", 0) == 5, what="the written layers at once")
    dst = d_blocks(pair)
    assert all(landed(pair, i, blocks, dst) for i in range(5))
    for name in layers[5:]:
        feed.add(Piece(name, [blocks], [0]))
    feed.close()
    pair.until(lambda: recv_ok(pair, DRID), what="verified receive")
    assert stats(pair)["layer_writes"] == len(layers)
    pair.p.finish(RID)
    pair.settle()


def test_each_chunk_sends_the_blocks_it_wrote(pair_factory: Callable[..., Pair]) -> None:
    """Chunk 1 writes blocks 0-2 (block 2 half full), chunk 2 blocks 2-4."""
    pair = pair_factory()
    blocks, feed = registered_then_handed_over(pair, 5, 5)
    dst = d_blocks(pair)
    layers = names(pair)
    for name in layers:
        feed.add(Piece(name, [blocks[:3]], [0]))
    pair.until(lambda: stats(pair).get("layer_writes", 0) == len(layers), what="chunk 1")
    pair.until(lambda: all(landed(pair, i, blocks[:3], dst[:3]) for i in range(len(layers))))
    assert not any(pair.d.mem.arrays[i][dst[3:]].any() for i in range(len(layers)))
    for name in layers:
        feed.add(Piece(name, [blocks[2:]], [2]))
    feed.close()
    pair.until(lambda: recv_ok(pair, DRID), what="verified receive")
    pair.p.finish(RID)
    pair.settle()


def test_d_with_a_cached_prefix_gets_the_tail_layer_by_layer(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    # D holds the first 3 of P's 5 blocks
    blocks, feed = registered_then_handed_over(pair, 2, 5)
    dst = d_blocks(pair)
    for name in names(pair):
        feed.add(Piece(name, [blocks[:3]], [0]))  # only block 2 is D's ...
        feed.add(Piece(name, [blocks[2:]], [2]))
    feed.close()
    pair.until(lambda: "recv" in pair.d_kinds(DRID), what="receive")
    assert all(landed(pair, i, blocks[3:], dst) for i in range(len(names(pair))))
    pair.p.finish(RID)
    pair.settle()


def test_a_failed_layer_fails_the_push_once_after_the_posted_ones(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    pair.fabric.hold_writes = True
    blocks, feed = registered_then_handed_over(pair, 2, 2)
    layers = names(pair)
    feed.add(Piece(layers[0], [blocks], [0]))
    feed.add(Piece(layers[1], [blocks], [0]))
    pair.until(lambda: len(pair.fabric.writes) == 2, what="two layers in flight")
    with pair.fabric.lock:
        pair.fabric._finish(pair.fabric.writes[0], ok=False)
    for _ in range(20):
        pair.step()
    assert pair.d_kinds(DRID) == []  # the second WRITE may still land: D is not told yet
    feed.add(Piece(layers[2], [blocks], [0]))  # written after the failure: never posted
    for _ in range(5):
        pair.step()
    assert stats(pair)["layer_writes"] == 2
    pair.fabric.complete_writes()
    pair.until(lambda: "failed" in pair.d_kinds(DRID), what="D told of the failure")
    feed.close()
    for _ in range(20):
        pair.step()
    assert pair.d_kinds(DRID) == ["failed"]
    assert stats(pair)["layer_writes"] == 2
    pair.p.finish(RID)
    pair.until(lambda: pair.p_kinds(RID).count("sent") == 1, what="P's blocks freed")
    pair.settle()


def test_a_cancel_stops_further_layers(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    pair.fabric.hold_writes = True
    blocks, feed = registered_then_handed_over(pair, 3, 3)
    layers = names(pair)
    feed.add(Piece(layers[0], [blocks], [0]))
    pair.until(lambda: len(pair.fabric.writes) == 1, what="one layer in flight")
    pair.d.abort(DRID)
    legs = pair.p.worker.producer.by_dkey
    saw = lambda: any(t.state is State.CANCELLING for t in legs.values())  # noqa: E731
    pair.until(saw, what="P saw the cancel")
    for name in layers[1:]:
        feed.add(Piece(name, [blocks], [0]))
    feed.close()
    for _ in range(20):
        pair.step()
    assert stats(pair)["layer_writes"] == 1  # nothing posted after the cancel
    assert pair.d.held_blocks() == 3  # the posted WRITE may still land: D keeps its blocks
    pair.fabric.complete_writes()
    pair.until(lambda: "released" in pair.d_kinds(DRID), what="released after the WRITE ended")
    pair.p.finish(RID)
    pair.until(lambda: "sent" in pair.p_kinds(RID), what="P's blocks freed")
    pair.settle()


def test_a_prompt_given_up_fails_its_push(pair_factory: Callable[..., Pair]) -> None:
    pair = pair_factory()
    blocks, feed = registered_then_handed_over(pair, 2, 2)
    feed.add(Piece(names(pair)[0], [blocks], [0]))
    pair.until(lambda: stats(pair).get("layer_writes", 0) == 1)
    feed.close("preempted")
    pair.until(lambda: "failed" in pair.d_kinds(DRID), what="D told of the failure")
    reasons = [i["reason"] for k, r, i in pair.d_events if k == "failed" and r == DRID]
    assert len(reasons) == 1 and "preempted" in reasons[0]
    pair.p.finish(RID)
    pair.settle()


def test_feed_blocks_follow_the_pieces() -> None:
    feed = LayerFeed([4])
    feed.add(Piece("a", [[7, 8, 9]], [0]))
    feed.add(Piece("a", [[9, 3]], [2]))
    assert feed.blocks() == [[7, 8, 9, 3]]


def test_a_region_of_several_layers_goes_whole_once_the_feed_closes(
    pair_factory: Callable[..., Pair],
) -> None:
    """Packed rows hold every layer of a block: no WRITE can carry one layer alone."""
    from kvpush_bench.sim.ranks import RankShape

    pair = pair_factory(shape=RankShape(mla=True, packed=True))
    blocks, feed = registered_then_handed_over(pair, 3, 3)
    members = pair.p.mem.layout.regions[0].members
    assert len(members) > 1
    for name in members:
        feed.add(Piece(name, [blocks], [0]))
    for _ in range(10):
        pair.step()
    assert stats(pair).get("layer_writes", 0) == 0  # the feed is open: more may come
    feed.close()
    pair.until(lambda: recv_ok(pair, DRID), what="verified receive")
    assert stats(pair)["layer_writes"] == 1
    pair.p.finish(RID)
    pair.settle()
