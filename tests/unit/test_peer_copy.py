"""The peer-copy hook (core/peer_copy.py) in the core's push, over the in-memory transport."""

from __future__ import annotations

import array
import ctypes
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvpush.core.errors import ConfigError
from kvpush.core.lane import CompletionLane, LaneView
from kvpush.core.peer_copy import CopyDst
from kvpush.core.types import WorkerConfig
from kvpush_bench.sim.engine import content_key
from tests.conftest import wait_until
from tests.unit.test_push_states import Pair

# test_push_states.Pair's fast heartbeats, with the default handshake timeout (CI machines
# can be busy)
WORKER = {"handshake_timeout_s": WorkerConfig.handshake_timeout_s}


def apply_pieces(dst: CopyDst, src: list[Any], move: Any) -> None:
    """What the kernel does, one block and piece at a time: ``move(dst, src, n)``."""
    for sb, db, ss, ds, so, do, n, sg, dg in dst.pieces.tolist():
        for s, d in zip(list(src[sg]), dst.dst[dg].tolist(), strict=True):
            move(db + d * ds + do, sb + s * ss + so, n)


class MemmovePeerCopy:
    """The PeerCopyHook protocol in one process: "mapping" a peer is knowing its host.

    ``hold``: launched copies stay unfinished (and their lane words unwritten) until
    ``release()``, as a kernel still running would.
    """

    def __init__(self, host: str, fail: bool = False, hold: bool = False) -> None:
        self.host = host
        self.fail = fail
        self.fail_finish = False
        self.hold = hold
        self.copied = 0
        self.prepared = 0
        self.running: list[tuple[CopyDst, list[Any]]] = []
        self.afters = 0  # launches that had to follow an engine's device work
        self.forgotten: list[str] = []

    def export(self) -> bytes:
        return self.host.encode()

    def prepare(self, peer: str, exported: bytes, dst: CopyDst) -> object | None:
        if exported.decode() != self.host:
            return None
        self.prepared += 1
        return dst

    def launch(self, prepared: object, src: Sequence[Any], after: Any = None) -> bool:
        assert isinstance(prepared, CopyDst)
        if self.fail:
            raise RuntimeError("illegal address")
        if after is not None:  # what a device hook orders its copy behind
            after.synchronize()
            self.afters += 1
        self.running.append((prepared, list(src)))
        if not self.hold:
            self.release()
        return prepared.signal is not None

    def release(self) -> None:
        for dst, src in self.running:
            apply_pieces(dst, src, ctypes.memmove)
            self.copied += 1
            if dst.signal is not None:  # what the kernel's last block does
                view = LaneView(dst.signal.lane)
                view.set(dst.signal.slot, dst.signal.gen)
                view.close()
        self.running.clear()

    def finished(self, prepared: object) -> bool:
        if self.fail_finish:
            raise RuntimeError("the copy stream failed")
        return all(d is not prepared for d, _ in self.running)

    def forget(self, peer: str) -> None:
        self.forgotten.append(peer)


class CopyPair(Pair):
    """P and D SimEngines over the in-memory transport, each with its peer-copy hook."""

    def __init__(
        self, p: MemmovePeerCopy | None, d: MemmovePeerCopy | None, d_worker: Any = None
    ) -> None:
        super().__init__(
            d_kw={"worker": d_worker or {}},
            p_engine={"peer_copy": p},
            d_engine={"peer_copy": d},
            layers=2,
            num_blocks=256,
            block_bytes=4096,
            worker=WORKER,
        )

    def push(self, rid: str, n: int) -> None:
        self.register(rid, rid, n)
        self.until(lambda: self.p.worker.snapshot()["pending_registrations"] > 0, 30)
        self.p.prefill(rid, rid, n)

    def outcome(self, rid: str) -> tuple[str, dict[str, Any]]:
        def ended() -> bool:
            return any(r == rid and k in ("recv", "failed") for k, r, _ in self.d_events)

        self.until(ended, 30, f"{rid} to end")
        self.until(lambda: self.p.held_blocks() == 0, 30, "P to free its blocks")
        return next((k, info) for k, r, info in self.d_events if r == rid and k != "registered")


@pytest.fixture
def pair() -> Any:
    made: list[CopyPair] = []

    def make(p: MemmovePeerCopy | None, d: MemmovePeerCopy | None, **kw: Any) -> CopyPair:
        made.append(CopyPair(p, d, kw.get("d_worker", {})))
        return made[-1]

    yield make
    for pr in made:
        pr.close()


def test_same_host_copies_and_only_notifies(pair: Any) -> None:
    hook = MemmovePeerCopy("h1")
    pr = pair(hook, MemmovePeerCopy("h1"))
    for i, n in enumerate([1, 6, 19]):
        pr.push(f"r{i}", n)
        kind, info = pr.outcome(f"r{i}")
        assert kind == "recv" and info["bad_regions"] == 0, info
    st = pr.p.worker.stats
    assert st["copies"] == 3 and st["writes"] == 0 and hook.copied == 3
    assert st["copy_blocks"] == 1 + 6 + 19 and st["write_bytes"] > 0


@pytest.mark.parametrize("d_hook", [MemmovePeerCopy("other"), None], ids=["other-host", "no-hook"])
def test_declined_or_absent_falls_back_to_the_write(pair: Any, d_hook: Any) -> None:
    pr = pair(MemmovePeerCopy("h1"), d_hook)
    for rid in ("r0", "r1"):
        pr.push(rid, 5)
        kind, info = pr.outcome(rid)
        assert kind == "recv" and info["bad_regions"] == 0
    st = pr.p.worker.stats
    assert st["writes"] == 2 and st["copies"] == 0
    # Declined once per peer: the second transfer goes straight to the WRITE.
    assert st["copy_declined"] == (1 if d_hook is not None else 0)


def test_failed_copy_fails_the_transfer_and_frees_both_sides(pair: Any) -> None:
    pr = pair(MemmovePeerCopy("h1", fail=True), MemmovePeerCopy("h1"))
    pr.push("r0", 3)
    kind, info = pr.outcome("r0")  # also waits for P to free its blocks
    assert kind == "failed" and "direct copy failed" in info["reason"]
    assert pr.p.worker.stats["copy_failed"] == 1 and pr.p.worker.stats["writes"] == 0
    # P's worker lives on: the next transfer (copying again) succeeds.
    pr.p.worker.peer_copy.fail = False  # type: ignore[union-attr]
    pr.push("r1", 2)
    assert pr.outcome("r1")[0] == "recv"


def test_forgetting_a_peer_drops_its_mapping(pair: Any) -> None:
    hook = MemmovePeerCopy("h1")
    pr = pair(hook, MemmovePeerCopy("h1"))
    pr.push("r0", 1)
    pr.outcome("r0")
    agent = pr.d.worker.transport.agent_name
    pr.p.worker.peers.forget(agent)
    assert hook.forgotten == [agent]


def test_lane_word_ends_the_receive_and_the_copy_was_armed_at_registration(pair: Any) -> None:
    hook = MemmovePeerCopy("h1")
    pr = pair(hook, MemmovePeerCopy("h1"))
    for i, n in enumerate([4, 9]):
        pr.push(f"r{i}", n)
        kind, info = pr.outcome(f"r{i}")
        assert kind == "recv" and info["bad_regions"] == 0, info
    p, d = pr.p.worker, pr.d.worker
    assert d.copies.name is not None and d.info.lane == d.copies.name
    # Both ended by the lane word, no completion notification. The second was prepared
    # when D registered (push() lets the registration reach P before the prefill ends);
    # the first could not be: P had not connected to D yet.
    assert d.stats["lane_done"] == 2 and d.stats["recv_done"] == 2
    assert p.stats["copy_armed"] == 1 and hook.prepared == 2 and p.stats["copies_done"] == 2
    assert p.stats["copy_early"] == 1  # and launched before the leg's bookkeeping
    assert not d.copies.waiting and not d.copies.covered()  # every word given back


def test_p_holds_its_blocks_until_a_launched_copy_finishes(pair: Any) -> None:
    hook = MemmovePeerCopy("h1", hold=True)
    pr = pair(hook, MemmovePeerCopy("h1"))
    pr.push("r0", 6)
    wait_until(lambda: hook.running, 30, pr.step, "the launch")
    for _ in range(20):  # the copy "runs": D sees no word, P keeps its blocks
        pr.step()
    assert not any(r == "r0" for k, r, _ in pr.d_events if k in ("recv", "failed"))
    assert pr.p.held_blocks() == 6
    hook.release()
    kind, info = pr.outcome("r0")
    assert kind == "recv" and info["bad_regions"] == 0


def test_a_copy_that_fails_after_its_launch_fails_the_receive(pair: Any) -> None:
    hook = MemmovePeerCopy("h1", hold=True)
    hook.fail_finish = True
    pr = pair(hook, MemmovePeerCopy("h1"))
    pr.push("r0", 3)
    kind, info = pr.outcome("r0")
    assert kind == "failed" and "direct copy failed" in info["reason"]
    assert pr.p.worker.stats["copy_failed"] == 1


def test_without_a_lane_word_p_notifies_only_after_the_copy_is_over(pair: Any) -> None:
    """No lane: the launch does not wait (engine thread); the completion goes to D only
    once ``finished`` says the copy is over, never while it still runs."""
    hook = MemmovePeerCopy("h1", hold=True)
    pr = pair(hook, MemmovePeerCopy("h1"), d_worker={"lane_slots": 0})
    pr.push("r0", 4)
    wait_until(lambda: hook.running, 30, pr.step, "the copy to be launched")
    for _ in range(50):  # the copy "runs": P must not tell D yet
        pr.step()
    assert not any(r == "r0" and k == "recv" for k, r, _ in pr.d_events)
    hook.release()
    kind, info = pr.outcome("r0")
    assert kind == "recv" and info["bad_regions"] == 0, info


@pytest.mark.parametrize("slots", [0, 1], ids=["no-lane", "lane-full"])
def test_without_a_lane_word_the_copy_is_notified_after_it(pair: Any, slots: int) -> None:
    pr = pair(MemmovePeerCopy("h1"), MemmovePeerCopy("h1"), d_worker={"lane_slots": slots})
    # Two registrations at once: with one word, the second goes without.
    pr.d.register("r0", "r0", 2, "P", "127.0.0.1", pr.p.spec.port)
    pr.d.register("r1", "r1", 5, "P", "127.0.0.1", pr.p.spec.port)
    wait_until(lambda: pr.p.worker.snapshot()["pending_registrations"] == 2, 30, pr.step)
    pr.p.prefill("r0", "r0", 2)
    pr.p.prefill("r1", "r1", 5)
    for rid in ("r0", "r1"):
        kind, info = pr.outcome(rid)
        assert kind == "recv" and info["bad_regions"] == 0
    d = pr.d.worker
    assert d.stats["lane_done"] == slots and d.stats["lane_full"] == slots
    assert (d.copies.name is None) == (slots == 0)


def test_no_lane_word_for_a_source_on_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = iter(["p-host/boot", "d-host/boot"])  # P's worker is made first
    monkeypatch.setattr("kvpush.core.worker.host_identity", lambda: next(hosts))
    pr = CopyPair(MemmovePeerCopy("h1"), MemmovePeerCopy("h1"))
    try:
        pr.push("r0", 4)
        kind, info = pr.outcome("r0")
        assert kind == "recv" and info["bad_regions"] == 0
        d = pr.d.worker
        # D has a lane but gave no word: the completion came over the transport
        assert d.stats["lane_done"] == 0 and d.copies.name is not None
        assert pr.p.worker.stats["copies"] == 1
    finally:
        pr.close()


def test_lane_words_complete_only_their_own_reservation() -> None:
    lane = CompletionLane(2)
    try:
        a = lane.reserve("a")
        assert a is not None
        lane.release(a[0])  # ended without its word (a watchdog expiry)
        b, c = lane.reserve("b"), lane.reserve("c")
        assert b is not None and c is not None and c[0] == a[0]  # reused last
        assert lane.reserve("d") is None
        view = LaneView(lane.name)
        view.set(a[0], a[1])  # a late write for the old reservation
        assert lane.poll() == []
        view.set(c[0], c[1])
        view.set(b[0], b[1])
        assert sorted(lane.poll()) == ["b", "c"] and not lane.waiting
        view.close()
    finally:
        lane.close()
    assert not os.path.exists(lane.path)


def test_many_waiting_words_are_checked_at_once() -> None:
    lane = CompletionLane(64)
    try:
        got = [lane.reserve(i) for i in range(40)]
        view = LaneView(lane.name)
        for i, (slot, gen) in enumerate(x for x in got if x is not None):
            view.set(slot, gen if i % 3 == 0 else gen + 1)
        assert sorted(lane.poll()) == list(range(0, 40, 3))
        assert len(lane.waiting) == 40 - len(range(0, 40, 3))
        view.close()
    finally:
        lane.close()


@pytest.mark.parametrize("name", ["../../etc/passwd", "kvpush-lane-x", "/dev/shm/kvpush-lane-0"])
def test_a_peer_cannot_name_any_file_as_its_lane(name: str) -> None:
    with pytest.raises(ConfigError, match="not a kvpush lane"):
        LaneView(name)


def kernel_moves(out: np.ndarray, rows: int) -> set[tuple[int, int, int]]:
    """(src, dst, length) of every piece, read from a table the way the kernel reads it."""
    table, ids = out[: 10 * rows].reshape(-1, 10), out[10 * rows :]
    got = set()
    for row in table.tolist():
        for i in range(row[9]):
            s = row[0] + ids[row[7] + i] * row[2] + row[4]
            d_at = row[1] + ids[row[8] + i] * row[3] + row[5]
            got.add((int(s), int(d_at), row[6]))
    return got


def test_kernel_table_addresses_what_the_pieces_say() -> None:
    """The CUDA kernel's table (gpu/peer_copy.py), read the way the kernel reads it."""
    from kvpush.core.peer_copy import copy_dst, copy_src
    from kvpush.core.routing import block_pieces, pair_regions
    from kvpush.gpu.peer_copy import fill_table, table_len
    from tests.unit.test_routing import Model, rank_layout

    m = Model(layers=2, heads=4, mla=False, packed=False, nblocks=16)
    p, d = rank_layout(m, 1, 0, 1, 0), rank_layout(m, 2, 1, 1, 0)  # head slices
    pieces = block_pieces(p, d, pair_regions(p, d))
    cd = copy_dst(d, pieces, [np.array([1, 7, 3])])
    src, nbytes = copy_src(p, cd, [[5, 2, 9]])
    assert nbytes == 3 * int(pieces[:, 6].sum())
    mapped = pieces[:, 1] + 10_000  # D's memory seen at another address
    out = np.zeros(table_len(pieces, src, cd.dst), dtype=np.int64)
    assert fill_table(out, pieces, mapped, src, cd.dst) == 3
    got, want = kernel_moves(out, len(pieces)), set()
    apply_pieces(cd, src, lambda dst, s, n: want.add((s, dst + 10_000, n)))
    assert got == want and len(got) == 3 * len(pieces)


def test_copy_halves_refuse_what_does_not_fit() -> None:
    from kvpush.core.errors import LayoutError
    from kvpush.core.peer_copy import copy_dst, copy_src, single_src
    from kvpush.core.routing import block_pieces, pair_regions
    from tests.unit.test_routing import Model, rank_layout

    m = Model(layers=2, heads=4, mla=False, packed=False, nblocks=16)
    p, d = rank_layout(m, 1, 0, 1, 0), rank_layout(m, 1, 0, 1, 0)
    pieces = block_pieces(p, d, pair_regions(p, d))
    with pytest.raises(LayoutError, match="outside"):
        copy_dst(d, pieces, [np.array([1, 16])])
    cd = copy_dst(d, pieces, [np.array([1, 2])])
    assert cd.single and cd.dst_max == [2]
    for bad, why in (([1], "P holds 1"), ([1, 16], "outside"), ([-1, 2], "outside")):
        with pytest.raises(LayoutError, match=why):
            copy_src(p, cd, [bad])
    with pytest.raises(LayoutError, match="outside"):
        copy_src(p, cd, [np.array([3, 99])])
    for not_ints in ([1, "2"], [1, 2.0], np.array([1.0, 2.0])):
        with pytest.raises(LayoutError, match="integers"):
            copy_src(p, cd, [not_ints])
    # D may hold a prefix of the request: P copies the tail of its blocks.
    for mine in ([7, 1, 2], np.array([7, 1, 2]), np.array([7, 1, 2], dtype=np.uint32)):
        ids, nbytes = single_src(16, cd, mine)
        assert list(ids) == [1, 2] and nbytes == 2 * cd.block_bytes == 2 * sum(cd.row_bytes)
        # short lists come packed as int64 (the GPU hook copies them with one memcpy)
        assert isinstance(ids, array.array) and ids.typecode == "q"
    for not_ints in ([1, 2.5], np.array([1.0, 2.0])):
        with pytest.raises(LayoutError, match="integers"):
            single_src(16, cd, not_ints)
    with pytest.raises(LayoutError, match="integers"):
        single_src(16, cd, [1, 2**64])  # too large for int64: refused, not wrapped
    # past SHORT_IDS: numpy checks the range; an array stays as it is
    m2 = Model(layers=2, heads=4, mla=False, packed=False, nblocks=600)
    p2, d2 = rank_layout(m2, 1, 0, 1, 0), rank_layout(m2, 1, 0, 1, 0)
    big = copy_dst(d2, block_pieces(p2, d2, pair_regions(p2, d2)), [np.arange(300)])
    ids, _ = single_src(600, big, np.arange(300))
    assert isinstance(ids, np.ndarray) and list(ids) == list(range(300))
    ids, _ = single_src(600, big, list(range(300, 600)))  # a long list: packed too
    assert isinstance(ids, array.array) and ids[-1] == 599
    with pytest.raises(LayoutError, match="outside"):
        single_src(600, big, list(range(301, 601)))
    with pytest.raises(LayoutError, match="outside"):
        single_src(299, big, np.arange(300))


def test_route_reuses_translated_rows_and_bounds_ids_by_the_export() -> None:
    """The per-peer route (gpu/peer_copy.py): the prepared table (D's ids first, P's
    added at launch) moves what the general one does, and a destination id whose bytes
    leave what the peer exported is refused before any copy."""
    from kvpush.core.layout import KVLayout, Region
    from kvpush.core.peer_copy import copy_dst
    from kvpush.core.routing import block_pieces, pair_regions
    from kvpush.gpu.peer_copy import Span, _Mapped, _Route, table_len

    def lay(base: int) -> KVLayout:
        return KVLayout([Region("k", base, 256, 64), Region("v", base + 256 * 64, 256, 64)], 16)

    p, d = lay(1 << 20), lay(1 << 30)
    pieces = block_pieces(p, d, pair_regions(p, d))
    # D exported its whole K region and only the first 40 blocks of its V region.
    spans = [Span(1 << 30, 256 * 64, b""), Span((1 << 30) + 256 * 64, 256 * 40, b"")]
    route = _Route(_Mapped(spans, [1 << 40, 1 << 41]), pieces)
    assert route.single and route.max_id == [39]
    cd = copy_dst(d, pieces, [np.array([1, 39, 3])])
    assert route.fits(cd)
    src = [np.array([5, 2, 9])]
    fast = np.zeros(table_len(pieces, src, cd.dst), dtype=np.int64)
    at = route.head_for(fast, cd)
    fast[at : at + 3] = src[0]
    slow = np.zeros_like(fast)
    assert route.fill(slow, cd, src) == 3
    assert kernel_moves(fast, len(pieces)) == kernel_moves(slow, len(pieces))
    assert len(kernel_moves(fast, len(pieces))) == 3 * len(pieces)
    assert set(route.head[:, 1].tolist()) == {1 << 40, 1 << 41}  # D's bases, as mapped here
    assert not route.fits(copy_dst(d, pieces, [np.array([40])]))


def _own_a_lane(conn: Any) -> None:
    lane = CompletionLane(8)
    conn.send(lane.name)
    conn.recv()  # until killed


def test_a_lane_left_by_a_killed_decoder_is_removed_by_the_next_one() -> None:
    import multiprocessing as mp
    import signal

    from kvpush.core.lane import remove_stale_lanes

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_own_a_lane, args=(child,))
    owner.start()
    try:
        assert parent.poll(60), "the owner did not start"
        name = parent.recv()
        path = os.path.join("/dev/shm", name)
        mine = CompletionLane(8)
        # A live owner's lane (and ours) survive a sweep.
        assert name not in remove_stale_lanes() and os.path.exists(path)
        assert os.path.exists(mine.path)
        owner.kill()  # SIGKILL: no cleanup runs
        owner.join(30)
        assert owner.exitcode == -signal.SIGKILL and os.path.exists(path)
        other = CompletionLane(8)  # the next decoder on this host sweeps on creation
        assert not os.path.exists(path)
        assert os.path.exists(mine.path) and os.path.exists(other.path)
        other.close()
        mine.close()
        assert not os.path.exists(mine.path) and not os.path.exists(other.path)
    finally:
        if owner.is_alive():
            owner.kill()
        owner.join(30)


class DeviceWork:
    """StagedBlocks.after as an engine's CUDA event: the prefill's writes happen when the
    work is waited for, or at the third query (the device got there meanwhile); a reader
    that reads before either finds the blocks unwritten."""

    def __init__(self, write: Any) -> None:
        self.write, self.waits, self.queries = write, 0, 0

    def query(self) -> bool:
        self.queries += 1
        if self.write is not None and self.queries >= 3:
            self.write()
            self.write = None
        return self.write is None

    def synchronize(self) -> None:
        self.waits += 1
        if self.write is not None:
            self.write()
            self.write = None


def prefill_after(pr: CopyPair, rid: str, n: int) -> DeviceWork:
    """P's prefill handed over before its writes are done (``after``), then D's outcome."""
    p = pr.p
    pr.d.register(rid, rid, n, "P", "127.0.0.1", p.spec.port)
    wait_until(lambda: p.worker.snapshot()["pending_registrations"] > 0, 30, pr.step)
    blocks = p._alloc(n)
    assert blocks is not None
    work = DeviceWork(lambda: p.mem.fill(content_key(rid, rid), blocks))
    p.p_reqs[rid] = blocks
    p.sched.request_finished(rid, [blocks], rid, after=work)
    kind, info = pr.outcome(rid)
    assert kind == "recv" and info["bad_regions"] == 0, info  # nothing read early
    return work


@pytest.mark.parametrize("copy", [True, False], ids=["copy", "write"])
def test_blocks_handed_over_before_their_writes_are_read_after_them(pair: Any, copy: bool) -> None:
    """StagedBlocks.after: the peer copy is given the event to queue behind (the hook
    waits here); a WRITE is posted only once a query says the event is done, and the
    producer never waits for it (it may run on the engine's thread)."""
    p_hook = MemmovePeerCopy("h1")
    pr = pair(p_hook, MemmovePeerCopy("h1" if copy else "other"))
    for i in range(2):  # the second copy was armed at registration (the early launch)
        work = prefill_after(pr, f"r{i}", 3)
        assert work.waits == (1 if copy else 0)
        assert copy or work.queries >= 3
    st = pr.p.worker.stats
    assert (st["copies"], st["writes"]) == ((2, 0) if copy else (0, 2))
    assert p_hook.afters == (2 if copy else 0)


def test_a_layer_wise_leg_on_the_copy_route_fails_once(pair: Any) -> None:
    """The connector makes no feed where the copy hook is (prompts go whole there); a
    feed that reaches a copy peer anyway fails its leg at once, with one PUSH_FAIL."""
    from kvpush.core.layers import LayerFeed
    from kvpush.core.types import StagedBlocks

    pr = pair(MemmovePeerCopy("h1"), MemmovePeerCopy("h1"))
    pr.register("r0", "r0", 2)
    pr.until(lambda: pr.p.worker.snapshot()["pending_registrations"] > 0, 30)
    blocks = pr.p._alloc(2)
    pr.p.p_reqs["r0"] = blocks
    pr.p.sched.hand_over("r0", [blocks], "r0", layered=True)
    pr.p.worker.hand_over([StagedBlocks("r0", [blocks], "r0", feed=LayerFeed([2]))])
    pr.until(lambda: any(k == "failed" for k, r, _ in pr.d_events if r == "r0"), 30, "D failed")
    reasons = [i["reason"] for k, r, i in pr.d_events if k == "failed" and r == "r0"]
    assert len(reasons) == 1 and "layer-wise" in reasons[0]
    assert pr.p.worker.stats["copies"] == 0 and pr.p.worker.stats.get("layer_writes", 0) == 0
    pr.p.finish("r0")
    pr.until(lambda: pr.p.held_blocks() == 0, 30, "P to free its blocks")
