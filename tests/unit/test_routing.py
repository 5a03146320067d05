"""Routing between heterogeneous layouts: every source byte lands on exactly its destination."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core import routing
from kvpush.core.errors import LayoutError
from kvpush.core.few_descs import SHORT_ROWS
from kvpush.core.layout import KVLayout, PackedMember, Region
from kvpush.core.routing import (
    block_pieces,
    build_pair_descs,
    coalesce,
    coalesce_equal,
    d_sources,
    p_targets,
    pair_regions,
)
from kvpush.core.transport import rows_array

CHUNK = 8  # bytes of one head's page in one block (tiny, so memories stay small)


@dataclass
class Model:
    layers: int
    heads: int  # total KV heads (1 for MLA)
    mla: bool
    packed: bool
    nblocks: int


def rank_layout(m: Model, tp: int, rank: int, pp: int, stage: int) -> KVLayout:
    """One rank's layout, its regions laid out back to back from address 0."""
    per_stage = m.layers // pp
    layers = list(range(stage * per_stage, (stage + 1) * per_stage))
    if m.packed:
        row = [PackedMember(f"L{li}", k * CHUNK, CHUNK) for k, li in enumerate(layers)]
        regions = [Region("rows", 0, CHUNK * len(layers), m.nblocks, packed=row)]
    else:
        heads = 0 if m.mla else m.heads // tp
        blen = CHUNK * (1 if m.mla else heads)
        regions = [
            Region(f"L{li}", k * blen * m.nblocks, blen, m.nblocks, kv_heads=heads)
            for k, li in enumerate(layers)
        ]
    return KVLayout(
        regions=regions,
        block_size=16,
        tp_rank=rank,
        tp_size=tp,
        pp_rank=stage,
        pp_size=pp,
        attention="mla" if m.mla else "standard",
        backends=["FLASHMLA"] if m.mla else [],
    )


def size(layout: KVLayout) -> int:
    return max(r.base_addr + r.nbytes for r in layout.regions)


def value(layer: int, head: int, pos: int, byte: np.ndarray) -> np.ndarray:
    return ((layer * 64 + head) * 4096 + pos) * 1024 + byte


def fill(m: Model, lay: KVLayout, blocks: list[int]) -> np.ndarray:
    mem = np.full(size(lay), -1, dtype=np.int64)
    for pos, b in enumerate(blocks):
        for layer, head, addr in _places(m, lay, b):
            mem[addr : addr + CHUNK] = value(layer, head, pos, np.arange(CHUNK))
    return mem


def _places(m: Model, lay: KVLayout, block: int) -> list[tuple[int, int, int]]:
    """(layer, global head, address) of every head page of one block."""
    out = []
    for r in lay.regions:
        if r.packed:
            for pm in r.packed:
                out.append((int(pm.layer[1:]), 0, r.base_addr + block * r.block_len + pm.offset))
            continue
        layer = int(r.name[1:])
        heads = r.kv_heads or 1
        first = 0 if m.mla else lay.tp_rank * heads
        for h in range(heads):
            out.append((layer, first + h, r.base_addr + block * r.block_len + h * CHUNK))
    return out


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_every_byte_reaches_exactly_its_destination(data: st.DataObject) -> None:
    mla = data.draw(st.booleans(), "mla")
    packed = mla and data.draw(st.booleans(), "packed")
    p_tp = data.draw(st.sampled_from([1, 2, 4]), "p_tp")
    d_tp = data.draw(st.sampled_from([1, 2, 4]), "d_tp")
    p_pp = data.draw(st.sampled_from([1, 2]), "p_pp")
    m = Model(layers=2 * p_pp, heads=1 if mla else 4, mla=mla, packed=packed, nblocks=12)
    n = data.draw(st.integers(1, 6), "n")
    src = data.draw(st.permutations(range(m.nblocks)), "src")[:n]
    dst = data.draw(st.permutations(range(m.nblocks)), "dst")[:n]
    att = "mla" if mla else "standard"
    for j in range(d_tp):
        d_lay = rank_layout(m, d_tp, j, 1, 0)
        d_mem = np.full(size(d_lay), -1, dtype=np.int64)
        d_mem2 = d_mem.copy()  # the same, moved by block_pieces (the peer-copy kernel's rows)
        writers = 0
        for stage in range(p_pp):
            for i in range(p_tp):
                p_lay = rank_layout(m, p_tp, i, p_pp, stage)
                pairs = pair_regions(p_lay, d_lay)
                if j not in p_targets(i, p_tp, d_tp, att):
                    continue
                assert i in d_sources(j, d_tp, p_tp, att)
                writers += 1
                p_mem = fill(m, p_lay, src)
                s, d = build_pair_descs(p_lay, d_lay, pairs, [src], [dst])
                for (sa, ln, _), (da, ln2, _) in zip(
                    rows_array(s).tolist(), rows_array(d).tolist(), strict=True
                ):
                    assert ln == ln2 and ln > 0
                    d_mem[da : da + ln] = p_mem[sa : sa + ln]
                for sb, db, ss, ds, so, do, ln, _, _ in block_pieces(p_lay, d_lay, pairs).tolist():
                    for sid, did in zip(src, dst, strict=True):
                        at, fr = db + did * ds + do, sb + sid * ss + so
                        d_mem2[at : at + ln] = p_mem[fr : fr + ln]
        assert writers == p_pp * len(d_sources(j, d_tp, p_tp, att))
        expected = np.full_like(d_mem, -1)
        for pos, b in enumerate(dst):
            for layer, head, addr in _places(m, d_lay, b):
                expected[addr : addr + CHUNK] = value(layer, head, pos, np.arange(CHUNK))
        assert np.array_equal(d_mem, expected)
        assert np.array_equal(d_mem2, expected)


def test_coalescing_with_equal_tp_is_one_run_per_region() -> None:
    m = Model(layers=2, heads=4, mla=False, packed=False, nblocks=16)
    p, d = rank_layout(m, 2, 1, 1, 0), rank_layout(m, 2, 1, 1, 0)
    s, _ = build_pair_descs(p, d, pair_regions(p, d), [[3, 4, 5, 6]], [[8, 9, 10, 11]])
    assert len(s) == 2


@pytest.mark.parametrize("short", [True, False])
def test_runs_descending_on_both_sides_merge_in_ps_order(short: bool) -> None:
    """vLLM reuses the blocks it freed last first (those without a prefix-cache hash): a
    request's ids then run downwards on P and on D alike. Taken in P's order they are one
    run per region, on both paths."""
    m = Model(layers=2, heads=4, mla=False, packed=False, nblocks=16)
    p, d = rank_layout(m, 1, 0, 1, 0), rank_layout(m, 1, 0, 1, 0)
    src, dst = [9, 8, 7, 6, 2], [5, 4, 3, 2, 11]  # a descending run of 4, then a lone block
    with pytest.MonkeyPatch.context() as mp:
        if not short:
            mp.setattr(routing, "SHORT_ROWS", 0)  # numpy's path
        s, t = map(rows_array, build_pair_descs(p, d, pair_regions(p, d), [src], [dst]))
    blen = CHUNK * m.heads
    for k, region_base in enumerate([0, blen * m.nblocks]):  # two regions, rows pair by pair
        assert s[2 * k : 2 * k + 2].tolist() == [
            [region_base + 2 * blen, blen, 0],
            [region_base + 6 * blen, 4 * blen, 0],
        ]
        assert t[2 * k : 2 * k + 2].tolist() == [
            [region_base + 11 * blen, blen, 0],
            [region_base + 2 * blen, 4 * blen, 0],
        ]


def test_vllms_block_order_gives_one_descriptor_per_region() -> None:
    """vLLM's own allocator, on P and on D, serving the same requests one after another
    with prefix caching off (or blocks without a hash), whose freed blocks it hands out
    again last-freed first: each request's blocks, in P's order, are one run on both sides."""
    from vllm.v1.core.block_pool import BlockPool

    m = Model(layers=2, heads=4, mla=False, packed=False, nblocks=64)
    p, d = rank_layout(m, 1, 0, 1, 0), rank_layout(m, 1, 0, 1, 0)
    pools = BlockPool(m.nblocks, False, 16), BlockPool(m.nblocks, False, 16)
    given_order_runs = []
    for n in (8, 9, 10, 11):  # each request one block longer than the last
        src, dst = ([b.block_id for b in pool.get_new_blocks(n)] for pool in pools)
        s, _ = build_pair_descs(p, d, pair_regions(p, d), [src], [dst])
        assert len(s) == m.layers  # one run per region
        given_order_runs.append(1 + sum(b - a != 1 for a, b in zip(src, src[1:], strict=False)))
        for pool, ids in zip(pools, (src, dst), strict=True):  # as vLLM frees a request
            pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    assert given_order_runs == [1, 9, 3, 11]  # what the ids' own order would have given


def test_head_slices_from_two_p_ranks_into_one_d_rank() -> None:
    m = Model(layers=1, heads=4, mla=False, packed=False, nblocks=8)
    d = rank_layout(m, 1, 0, 1, 0)
    offsets = []
    for i in range(2):
        p = rank_layout(m, 2, i, 1, 0)
        (pair,) = pair_regions(p, d)
        assert not pair.whole and pair.segments[0].length == 2 * CHUNK
        offsets.append(pair.segments[0].dst_off)
    assert offsets == [0, 2 * CHUNK]


def layout(**kw: object) -> KVLayout:
    base: dict[str, object] = {"regions": [Region("L0", 0, 64, 8)], "block_size": 16}
    base.update(kw)
    return KVLayout(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "p, d, why",
    [
        (layout(), layout(pp_size=2, pp_rank=1), "decode-side pipeline"),
        (layout(pp_size=2, mamba=True), layout(), "Mamba/SSM"),
        (layout(), layout(regions=[Region("L0", 0, 32, 8)]), "page size"),
        (layout(regions=[Region("L0", 0, 64, 8), Region("L9", 512, 64, 8)]), layout(), "layer L9"),
        (
            layout(
                regions=[Region("rows", 0, 64, 8, packed=[PackedMember("L0", 0, 64)])], pp_size=2
            ),
            layout(regions=[Region("rows", 0, 64, 8, packed=[PackedMember("L0", 0, 64)])]),
            "requires MLA",
        ),
        (
            layout(
                attention="mla", regions=[Region("r", 0, 64, 8, packed=[PackedMember("L0", 0, 64)])]
            ),
            layout(
                attention="mla", regions=[Region("r", 0, 64, 8, packed=[PackedMember("L0", 0, 32)])]
            ),
            "page size of layer L0",
        ),
        (
            layout(regions=[Region("L0", 0, 64, 8, kv_heads=2)], tp_size=2),
            layout(regions=[Region("L0", 0, 64, 8)]),
            "needs kv_heads",
        ),
        (
            layout(regions=[Region("L0", 0, 64, 8, kv_heads=2)], tp_size=2),
            layout(regions=[Region("L0", 0, 64, 8, kv_heads=2)], tp_size=1),
            "KV heads",
        ),
        (
            layout(
                attention="mla",
                backends=["A"],
                regions=[Region("r", 0, 8, 8, packed=[PackedMember("L0", 0, 8)])],
            ),
            layout(
                attention="mla",
                backends=["B"],
                regions=[Region("r", 0, 8, 8, packed=[PackedMember("L0", 0, 8)])],
            ),
            "backends",
        ),
    ],
)
def test_unsupported_combinations_are_refused(p: KVLayout, d: KVLayout, why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        pair_regions(p, d)


def test_backend_order_does_not_matter_and_pp_stage_offsets_differ() -> None:
    d_row = [PackedMember(f"L{i}", i * 16, 16) for i in range(4)]
    p_row = [PackedMember("L2", 0, 16), PackedMember("L3", 16, 16)]
    p = layout(
        attention="mla",
        backends=["X", "Y"],
        pp_size=2,
        pp_rank=1,
        regions=[Region("rows", 0, 32, 8, packed=p_row)],
    )
    d = layout(
        attention="mla", backends=["Y", "X"], regions=[Region("rows", 0, 64, 6, packed=d_row)]
    )
    (pair,) = pair_regions(p, d)
    assert [(s.src_off, s.dst_off) for s in pair.segments] == [(0, 32), (16, 48)]
    s, dd = map(rows_array, build_pair_descs(p, d, [pair], [[1, 2]], [[4, 5]]))
    assert s.tolist() == [[32, 32, 0], [64, 32, 0]]  # the two pages of a row are adjacent
    assert dd.tolist() == [[4 * 64 + 32, 32, 0], [5 * 64 + 32, 32, 0]]


def test_pooled_regions_with_different_representatives() -> None:
    p = layout(regions=[Region("attn.a", 0, 64, 8, layers=["attn.a", "attn.b"])])
    d = layout(regions=[Region("attn.b", 4096, 64, 8, layers=["attn.b", "attn.a", "attn.c"])])
    (pair,) = pair_regions(p, d)
    assert pair.whole and pair.dst == 0
    split = layout(
        regions=[
            Region("x", 0, 64, 8, layers=["attn.a"]),
            Region("y", 512, 64, 8, layers=["attn.b"]),
        ]
    )
    with pytest.raises(LayoutError, match="several peer regions"):
        pair_regions(p, split)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_equal_length_coalescing_matches_the_general_one(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 40))
    ids = st.lists(st.integers(0, 12), min_size=n, max_size=n)
    sa = np.array(data.draw(ids), dtype=np.int64) * 16
    da = np.array(data.draw(ids), dtype=np.int64) * 16 + 4096
    want = coalesce(sa, da, np.full(n, 16, dtype=np.int64))
    got = coalesce_equal(sa, da, 16)
    for w, g in zip(want, got, strict=True):
        assert w.tolist() == g.tolist()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_few_rows_with_builtins_equal_numpy_rows(data: st.DataObject) -> None:
    """A short push's descriptors come from builtins; they must be numpy's, row for row."""
    ratio = data.draw(st.sampled_from([1, 2]), "physical per logical")
    layers = data.draw(st.integers(1, 4), "regions")
    nblocks = 16

    def layout(base: int) -> KVLayout:
        regions = [
            Region(f"l{i}", base + i * 4096 * nblocks * ratio, 4096, nblocks * ratio, device_id=i)
            for i in range(layers)
        ]
        return KVLayout(regions, block_size=16, physical_per_logical=ratio)

    p, d = layout(1 << 20), layout(1 << 30)
    pairs = pair_regions(p, d)
    n = data.draw(st.integers(0, 8), "blocks")
    # Runs (consecutive ids on both sides) as well as scattered ids.
    start = data.draw(st.integers(0, nblocks - n), "start")
    src = list(range(start, start + n))
    dst = data.draw(st.permutations(range(nblocks)), "dst")[:n]
    if data.draw(st.booleans(), "shuffle src"):
        src = data.draw(st.permutations(src), "src")
    assert len(pairs) * n * ratio <= SHORT_ROWS  # the builtins' path
    few = build_pair_descs(p, d, pairs, [src], [dst])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(routing, "SHORT_ROWS", 0)  # numpy's path for every push
        with_numpy = build_pair_descs(p, d, pairs, [src], [dst])
    for a, b in zip(few, with_numpy, strict=True):
        assert isinstance(b, np.ndarray) and b.dtype == np.int64
        if n:  # (no rows: the empty array either way)
            assert isinstance(a, list) and all(type(v) is int for row in a for v in row)
        assert rows_array(a).tolist() == b.tolist()
