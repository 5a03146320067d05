from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core.errors import LayoutError
from kvpush.core.layout import (
    KVLayout,
    Region,
    as_ids,
    expand,
    validate_block_ids,
)
from kvpush.core.routing import (
    _per_pair_descs,
    _uniform,
    _uniform_descs,
    block_pieces,
    build_pair_descs,
    check_compatible,
    pair_regions,
)
from kvpush.core.transport import rows_array


def write_descs(
    local: KVLayout, remote: KVLayout, src: list[list[int]], dst: list[list[int]]
) -> tuple[Any, Any]:
    """The WRITE descriptors of local blocks ``src`` into remote blocks ``dst`` (arrays)."""
    s, d = build_pair_descs(local, remote, pair_regions(local, remote), src, dst)
    return rows_array(s), rows_array(d)


def layout(
    base: int, nblocks: int = 64, blen: int = 256, ratio: int = 1, regions: int = 2
) -> KVLayout:
    span = nblocks * blen * ratio
    return KVLayout(
        regions=[
            Region(f"r{i}", base + i * span * 2, blen, nblocks * ratio) for i in range(regions)
        ],
        block_size=16,
        physical_per_logical=ratio,
    )


def test_expand() -> None:
    assert expand([2, 5], 1).tolist() == [2, 5]
    assert expand([2, 5], 3).tolist() == [6, 7, 8, 15, 16, 17]


def test_contiguous_runs_coalesce() -> None:
    src, dst = write_descs(layout(0), layout(1 << 30), [[1, 2, 3, 7, 8]], [[10, 11, 12, 13, 20]])
    # runs on both sides: (1-3 -> 10-12), (7 -> 13), (8 -> 20): three per region
    assert len(src) == 6
    assert src[:3, 1].tolist() == [768, 256, 256]
    assert dst[0, 0] == (1 << 30) + 10 * 256


def test_fully_contiguous_is_one_descriptor_per_region() -> None:
    src, _ = write_descs(layout(0), layout(1 << 30), [list(range(40))], [list(range(5, 45))])
    assert len(src) == 2


def test_ratio_difference_pairs_bytes() -> None:
    # P: 1 physical per logical of 512 B; D: 2 physical of 256 B per logical.
    p = layout(0, blen=512, ratio=1)
    d = layout(1 << 30, blen=256, ratio=2)
    check_compatible(p, d)
    src, dst = write_descs(p, d, [[0, 1]], [[4, 5]])
    assert src[:, 1].sum() == 2 * 2 * 512
    assert dst[0, 0] == (1 << 30) + 8 * 256  # logical 4 -> physical 8


@pytest.mark.parametrize(
    "ids, why",
    [
        ([[64]], "outside"),
        ([[-1]], "outside"),
        ([[1, 1]], "duplicate"),
        ([[1], [2]], "groups"),
        ([[1.5]], "integers"),
    ],
)
def test_validation(ids: list[list[int]], why: str) -> None:
    with pytest.raises(LayoutError, match=why):
        validate_block_ids(layout(0), ids)


def test_duplicates_found_by_marks_and_by_sort() -> None:
    small = KVLayout([Region("r", 0, 16, 64)], block_size=16)  # marks: few possible ids
    big = KVLayout([Region("r", 0, 16, 1 << 20)], block_size=16)  # sort: ids sparse
    for lay in (small, big):
        validate_block_ids(lay, [np.array([5, 3, 9])])
        with pytest.raises(LayoutError, match="duplicate"):
            validate_block_ids(lay, [np.array([5, 3, 5])])
        validate_block_ids(lay, [[5, 5]], unique_known=True)  # range only: caller checked


def test_as_ids() -> None:
    arr = np.arange(4, dtype=np.int64)
    assert as_ids(arr) is arr
    assert as_ids([3, 1]).tolist() == [3, 1]
    assert as_ids(np.array([2], dtype=np.int32)).dtype == np.int64
    assert as_ids([]).size == 0
    with pytest.raises(LayoutError, match="integers"):
        as_ids([1.5])  # type: ignore[list-item]


def test_incompatible_layouts() -> None:
    with pytest.raises(LayoutError, match="layer r2 is not advertised"):
        check_compatible(layout(0, regions=3), layout(0))
    check_compatible(layout(0), layout(0, regions=3))  # layers only D has are ignored
    with pytest.raises(LayoutError, match="bytes per block"):
        check_compatible(layout(0), layout(0, blen=128))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_source_byte_lands_on_its_destination(data: st.DataObject) -> None:
    nb = data.draw(st.integers(4, 24))
    rp, rd = data.draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 4)]))
    blen_logical = 8 * 4
    p = layout(0, nb, blen_logical // rp, rp, regions=2)
    d = layout(0, nb, blen_logical // rd, rd, regions=2)
    n = data.draw(st.integers(1, nb))
    src_ids = data.draw(st.permutations(range(nb)))[:n]
    dst_ids = data.draw(st.permutations(range(nb)))[:n]
    src, dst = write_descs(p, d, [src_ids], [dst_ids])
    # Simulate: memory is one byte array per side; sources hold their own address.
    mem_p = np.arange(4 * nb * blen_logical, dtype=np.int64)
    mem_d = np.full(4 * nb * blen_logical, -1, dtype=np.int64)
    for (sa, ln, _), (da, ln2, _) in zip(src.tolist(), dst.tolist(), strict=True):
        assert ln == ln2
        mem_d[da : da + ln] = mem_p[sa : sa + ln]
    # The peer-copy kernel's rows move the same bytes, whatever the physical split.
    by_pieces = np.full_like(mem_d, -1)
    for sb, db, ss, ds, so, do, ln, _, _ in block_pieces(p, d, pair_regions(p, d)).tolist():
        for s_id, d_id in zip(src_ids, dst_ids, strict=True):
            at, fr = db + d_id * ds + do, sb + s_id * ss + so
            by_pieces[at : at + ln] = mem_p[fr : fr + ln]
    assert np.array_equal(by_pieces, mem_d)
    for r in range(2):
        for s, t in zip(src_ids, dst_ids, strict=True):
            sa = p.regions[r].base_addr + s * blen_logical
            da = d.regions[r].base_addr + t * blen_logical
            assert (mem_d[da : da + blen_logical] == np.arange(sa, sa + blen_logical)).all()
    assert (mem_d >= 0).sum() == 2 * n * blen_logical  # nothing else touched


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_one_pass_descriptors_equal_the_per_region_ones(data: st.DataObject) -> None:
    """Whole blocks of one size on both sides (most models): every region's descriptors in
    one set of array operations, the same rows in the same order as region by region."""
    nb = data.draw(st.integers(2, 40))
    ratio = data.draw(st.sampled_from([1, 2]))
    regions = data.draw(st.integers(1, 5))
    p = layout(0, nb, 64, ratio, regions)
    d = layout(1 << 30, nb, 64, ratio, regions)
    moved = [msgspec.structs.replace(r, device_id=i % 2) for i, r in enumerate(p.regions)]
    p = msgspec.structs.replace(p, regions=moved)
    pairs = pair_regions(p, d)
    assert _uniform(p, d, pairs)
    n = data.draw(st.integers(0, nb))
    runs = data.draw(st.booleans())  # sorted ids: long runs to merge; else scattered
    src = data.draw(st.permutations(range(nb)))[:n]
    dst = data.draw(st.permutations(range(nb)))[:n]
    if runs:
        src, dst = sorted(src), sorted(dst)
    s_ids, d_ids = as_ids(src), as_ids(dst)
    one = tuple(map(rows_array, _uniform_descs(p, d, pairs, s_ids, d_ids)))
    per = _per_pair_descs(p, d, pairs, [s_ids], [d_ids])
    assert np.array_equal(one[0], per[0]) and np.array_equal(one[1], per[1])
    assert one[0].shape[1] == 3 and one[0].dtype == np.int64
