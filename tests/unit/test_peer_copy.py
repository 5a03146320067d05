"""The peer-copy hook (core/peer_copy.py) in the core's push, over the in-memory transport."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from kvpush.core.peer_copy import CopyPlan
from tests.unit.test_staging_hook import NumpyStaging, StagedPair


def apply_pieces(plan: CopyPlan, move: Any) -> None:
    """What the kernel does, one block and piece at a time: ``move(dst, src, n)``."""
    for sb, db, ss, ds, so, do, n, sg, dg in plan.pieces.tolist():
        for s, d in zip(plan.src[sg].tolist(), plan.dst[dg].tolist(), strict=True):
            move(db + d * ds + do, sb + s * ss + so, n)


class MemmovePeerCopy:
    """The PeerCopyHook protocol in one process: "mapping" a peer is knowing its host."""

    def __init__(self, host: str, fail: bool = False) -> None:
        self.host = host
        self.fail = fail
        self.copied = 0
        self.forgotten: list[str] = []

    def export(self) -> bytes:
        return self.host.encode()

    def copy(self, peer: str, exported: bytes, plan: CopyPlan) -> bool:
        if exported.decode() != self.host:
            return False
        if self.fail:
            raise RuntimeError("illegal address")
        apply_pieces(plan, ctypes.memmove)
        self.copied += 1
        return True

    def forget(self, peer: str) -> None:
        self.forgotten.append(peer)


@pytest.fixture
def pair() -> Any:
    made: list[StagedPair] = []

    def make(p: MemmovePeerCopy | None, d: MemmovePeerCopy | None, **kw: Any) -> StagedPair:
        made.append(
            StagedPair(kw.get("p_staging"), kw.get("d_staging"), {"peer_copy": p}, {"peer_copy": d})
        )
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


def test_copy_beats_staging_when_both_are_offered(pair: Any) -> None:
    staging = {"p_staging": NumpyStaging(1 << 20), "d_staging": NumpyStaging(1 << 20)}
    pr = pair(MemmovePeerCopy("h1"), MemmovePeerCopy("h1"), **staging)
    pr.push("r0", 7)
    assert pr.outcome("r0")[1]["bad_regions"] == 0
    assert pr.p.worker.stats["copies"] == 1 and pr.p.worker.stats["writes_staged"] == 0
    assert len(staging["d_staging"].slots) == 0  # D's unused slot was freed


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
    pr.p.worker.forget_peer(agent)
    assert hook.forgotten == [agent]


def test_kernel_table_addresses_what_the_pieces_say() -> None:
    """The CUDA kernel's table (gpu/peer_copy.py), read the way the kernel reads it."""
    from kvpush.core.peer_copy import copy_plan
    from kvpush.core.routing import block_pieces, pair_regions
    from kvpush.gpu.peer_copy import fill_table, table_len
    from tests.unit.test_routing import Model, rank_layout

    m = Model(layers=2, heads=4, mla=False, packed=False, nblocks=16)
    p, d = rank_layout(m, 1, 0, 1, 0), rank_layout(m, 2, 1, 1, 0)  # head slices
    pieces = block_pieces(p, d, pair_regions(p, d))
    plan = copy_plan(p, d, pieces, [[5, 2, 9]], [np.array([1, 7, 3])])
    mapped = pieces[:, 1] + 10_000  # D's memory seen at another address
    out = np.zeros(table_len(pieces, plan.src, plan.dst), dtype=np.int64)
    most = fill_table(out, pieces, mapped, plan.src, plan.dst)
    assert most == 3
    table, ids = out[: 10 * len(pieces)].reshape(-1, 10), out[10 * len(pieces) :]
    got, want = set(), set()
    for row in table.tolist():
        for i in range(row[9]):
            s = row[0] + ids[row[7] + i] * row[2] + row[4]
            d_at = row[1] + ids[row[8] + i] * row[3] + row[5]
            got.add((int(s), int(d_at), row[6]))
    apply_pieces(plan, lambda dst, src, n: want.add((src, dst + 10_000, n)))
    assert got == want and len(got) == 3 * len(pieces)


def test_route_reuses_translated_rows_and_bounds_ids_by_the_export() -> None:
    """The per-peer route (gpu/peer_copy.py): the fast table equals the general one, and a
    destination id whose bytes leave what the peer exported is refused before any copy."""
    from kvpush.core.layout import KVLayout, Region
    from kvpush.core.peer_copy import copy_plan
    from kvpush.core.routing import block_pieces, pair_regions
    from kvpush.gpu.peer_copy import Span, _Mapped, _Route, fill_table, table_len

    def lay(base: int) -> KVLayout:
        return KVLayout([Region("k", base, 256, 64), Region("v", base + 256 * 64, 256, 64)], 16)

    p, d = lay(1 << 20), lay(1 << 30)
    pieces = block_pieces(p, d, pair_regions(p, d))
    # D exported its whole K region and only the first 40 blocks of its V region.
    spans = [Span(1 << 30, 256 * 64, b""), Span((1 << 30) + 256 * 64, 256 * 40, b"")]
    route = _Route(_Mapped(spans, [1 << 40, 1 << 41]), pieces)
    assert route.single and route.max_id == [39]
    plan = copy_plan(p, d, pieces, [[5, 2, 9]], [np.array([1, 39, 3])])
    assert route.fits(plan)
    fast = np.zeros(table_len(pieces, plan.src, plan.dst), dtype=np.int64)
    slow = np.zeros_like(fast)
    assert route.fill(fast, plan) == fill_table(slow, pieces, route.head[:, 1], plan.src, plan.dst)
    assert fast.tolist() == slow.tolist()
    assert set(route.head[:, 1].tolist()) == {1 << 40, 1 << 41}  # D's bases, as mapped here
    assert not route.fits(copy_plan(p, d, pieces, [[5]], [np.array([40])]))
