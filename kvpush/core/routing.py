"""Which bytes of P's KV go where in D's: regions paired by layer name, heads by TP rank.

* Regions pair by the layer names they advertise (``Region.members``), not by index:
  a pipeline stage of P holds only some layers; D (PP=1) holds all; several pooled
  layers may share one region and the representative name may differ per side.
* With standard attention each rank holds a slice of the KV heads; a P rank writes
  the intersection of its heads with each D rank's, at the right offset of D's block.
  MLA pages are whole on every rank.
* Packed rows (all layers of a block in one row) pair layer by layer through
  ``Region.packed`` offsets.
Pairs are computed once per peer; descriptors per WRITE, contiguous runs coalesced.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.few_descs import SHORT_ROWS, few_uniform_descs
from kvpush.core.layout import (
    SHORT_IDS,
    KVLayout,
    Region,
    RegionPair,
    Segment,
    as_ids,
    coalesce,
    coalesce_equal,
    expand,
    extents,
    in_source_order,
    pair_extents,
    validate_block_ids,
)
from kvpush.core.transport import Rows


@functools.lru_cache(maxsize=256)
def p_targets(p_rank: int, p_tp: int, d_tp: int, attention: str) -> frozenset[int]:
    """D ranks one P rank writes to (cached: asked for every transfer)."""
    if attention == "mla":  # pages are replicated: D rank j reads from P rank j % p_tp
        return frozenset(j for j in range(d_tp) if j % p_tp == p_rank)
    return frozenset(j for j in range(d_tp) if _overlap(p_rank, p_tp, j, d_tp))


def d_sources(d_rank: int, d_tp: int, p_tp: int, attention: str) -> list[int]:
    """P ranks (per pipeline stage) one D rank receives from."""
    if attention == "mla":
        return [d_rank % p_tp]
    return [i for i in range(p_tp) if _overlap(i, p_tp, d_rank, d_tp)]


def _overlap(i: int, a: int, j: int, b: int) -> bool:
    # Head ranges [i/a, (i+1)/a) and [j/b, (j+1)/b) of the whole, scaled by a*b.
    return i * b < (j + 1) * a and j * a < (i + 1) * b


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise LayoutError unless blocks can be written from ``local`` into ``remote``."""
    pair_regions(local, remote)


def pair_regions(p: KVLayout, d: KVLayout) -> list[RegionPair]:
    """Pair P's regions with D's; raise LayoutError for anything unsupported or missing."""
    _check_shapes(p, d)
    owner: dict[str, int] = {}
    for k, r in enumerate(d.regions):
        for layer in r.members:
            if layer in owner:
                raise LayoutError(f"the peer advertises layer {layer} twice")
            owner[layer] = k
    pairs = []
    for i, lr in enumerate(p.regions):
        missing = [m for m in lr.members if m not in owner]
        if missing:
            raise LayoutError(
                f"layer {missing[0]} is not advertised by the peer (region {lr.name})"
            )
        dsts = {owner[m] for m in lr.members}
        if len(dsts) > 1:
            raise LayoutError(f"layers of region {lr.name} lie in several peer regions")
        k = dsts.pop()
        pair = _pair(p, d, i, k)
        if pair.whole or pair.segments:
            pairs.append(pair)
    return pairs


def _check_shapes(p: KVLayout, d: KVLayout) -> None:
    if p.block_size != d.block_size:
        raise LayoutError(f"block size {p.block_size} != peer's {d.block_size} tokens")
    if p.mem_type != d.mem_type and "VRAM" not in (p.mem_type, d.mem_type):
        raise LayoutError(f"memory type {p.mem_type} != peer's {d.mem_type}")
    if d.pp_size > 1:
        raise LayoutError("decode-side pipeline parallelism is unsupported (D must be PP=1)")
    if p.pp_size > 1 and (p.mamba or d.mamba):
        raise LayoutError("Mamba/SSM state is unsupported under pipeline parallelism")
    if p.attention != d.attention:
        raise LayoutError(f"attention {p.attention} != peer's {d.attention}")
    packed_p = any(r.packed for r in p.regions)
    if packed_p != any(r.packed for r in d.regions):
        raise LayoutError("one side has packed rows, the other not")
    if packed_p:
        if p.pp_size > 1 and p.attention != "mla":
            raise LayoutError("packed pipeline-parallel push requires MLA caches")
        if p.physical_per_logical != d.physical_per_logical:
            raise LayoutError("packed push requires equal P/D block sizes")
        if sorted(set(p.backends)) != sorted(set(d.backends)):
            raise LayoutError(
                f"attention backends {sorted(set(p.backends))} != peer's {sorted(set(d.backends))}"
            )
    if p.attention == "standard" and p.tp_size != d.tp_size:
        flat = [r.name for r in (*p.regions, *d.regions) if not r.kv_heads and not r.packed]
        if flat:
            raise LayoutError(f"heterogeneous TP needs kv_heads on every region ({flat[0]})")


def _pair(p: KVLayout, d: KVLayout, i: int, k: int) -> RegionPair:
    lr, rr = p.regions[i], d.regions[k]
    if lr.packed:
        return RegionPair(i, k, False, tuple(_packed_segments(lr, rr)))
    if p.attention == "standard" and lr.kv_heads and rr.kv_heads:
        return _head_pair(p, d, i, k)
    if p.logical_bytes(i) != d.logical_bytes(k):
        raise LayoutError(
            f"region {lr.name}: {p.logical_bytes(i)} bytes per block != peer's "
            f"{d.logical_bytes(k)} (page size mismatch)"
        )
    return RegionPair(i, k, True)


def _packed_segments(lr: Region, rr: Region) -> list[Segment]:
    slots = {m.layer: m for m in rr.packed}
    segs = []
    for m in lr.packed:
        other = slots.get(m.layer)
        if other is None:
            raise LayoutError(f"layer {m.layer} is not in the peer's packed rows")
        if other.page_len != m.page_len:
            raise LayoutError(
                f"page size of layer {m.layer}: {m.page_len} != peer's {other.page_len}"
            )
        if m.offset + m.page_len > lr.block_len or other.offset + m.page_len > rr.block_len:
            raise LayoutError(f"layer {m.layer}: page outside its row")
        segs.append(Segment(m.offset, other.offset, m.page_len))
    return segs


def _head_pair(p: KVLayout, d: KVLayout, i: int, k: int) -> RegionPair:
    lr, rr = p.regions[i], d.regions[k]
    hp, hd = lr.kv_heads, rr.kv_heads
    if hp * p.tp_size != hd * d.tp_size:
        raise LayoutError(f"region {lr.name}: {hp}x{p.tp_size} KV heads != peer's {hd}x{d.tp_size}")
    if lr.block_len % hp or rr.block_len % hd:
        raise LayoutError(f"region {lr.name}: block not divisible into its heads")
    chunk_p, chunk_d = lr.block_len // hp, rr.block_len // hd
    if chunk_p * p.physical_per_logical != chunk_d * d.physical_per_logical:
        raise LayoutError(f"region {lr.name}: bytes per head differ from the peer's (page size)")
    p_first, d_first = p.tp_rank * hp, d.tp_rank * hd
    lo, hi = max(p_first, d_first), min(p_first + hp, d_first + hd)
    if lo >= hi:
        return RegionPair(i, k, False)
    if hp == hd and p_first == d_first:
        return RegionPair(i, k, True)
    if p.physical_per_logical != d.physical_per_logical:
        raise LayoutError("a head slice needs equal physical block sizes on both sides")
    seg = Segment((lo - p_first) * chunk_p, (lo - d_first) * chunk_d, (hi - lo) * chunk_p)
    return RegionPair(i, k, False, (seg,))


def build_pair_descs(
    p: KVLayout,
    d: KVLayout,
    pairs: Sequence[RegionPair],
    src_groups: Sequence[Sequence[int] | np.ndarray],
    dst_groups: Sequence[Sequence[int] | np.ndarray],
    dst_unique: bool = False,
    dst_checked: bool = False,
) -> tuple[Rows, Rows]:
    """Nx3 (address, length, device) rows: P's blocks ``src_groups`` into D's ``dst_groups``
    (a list of tuples when they are few, core/few_descs.py; else int64 arrays).

    ``dst_unique``: D's ids were checked for duplicates already (on PUSH_REG arrival);
    ``dst_checked``: checked against D's layout as well (an armed WRITE).
    """
    # Long id lists become int64 arrays once here (no copy if they are already), not per
    # region; short ones stay as they are, for builtins.
    src_ids = [as_ids(g) if len(g) > SHORT_IDS else g for g in src_groups]
    dst_ids = [as_ids(g) if len(g) > SHORT_IDS else g for g in dst_groups]
    validate_block_ids(p, src_ids)
    if not dst_checked:
        validate_block_ids(d, dst_ids, unique_known=dst_unique)
    if _uniform(p, d, pairs):
        group = p.regions[pairs[0].src].group, d.regions[pairs[0].dst].group
        return _uniform_descs(p, d, pairs, src_ids[group[0]], dst_ids[group[1]])
    src_arrays = [as_ids(g) for g in src_ids]
    dst_arrays = [as_ids(g) for g in dst_ids]
    return _per_pair_descs(p, d, pairs, src_arrays, dst_arrays)


def _per_pair_descs(
    p: KVLayout,
    d: KVLayout,
    pairs: Sequence[RegionPair],
    src_arrays: Sequence[np.ndarray],
    dst_arrays: Sequence[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """``build_pair_descs`` for any pairs, one region pair at a time."""
    pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]] = []
    ordered: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for pair in pairs:
        lr, rr = p.regions[pair.src], d.regions[pair.dst]
        s_ids, d_ids = src_arrays[lr.group], dst_arrays[rr.group]
        if len(s_ids) != len(d_ids):
            raise LayoutError(
                f"region {lr.name}: {len(s_ids)} source blocks, {len(d_ids)} destination"
            )
        if not len(s_ids):
            continue
        key = (lr.group, rr.group)
        if key not in ordered:
            ordered[key] = in_source_order(s_ids, d_ids)
        s_ids, d_ids = ordered[key]
        if pair.whole and (lr.block_len, p.physical_per_logical) == (
            rr.block_len,
            d.physical_per_logical,
        ):
            # Physical blocks pair one to one: merge the pieces contiguous on both sides
            # (the same descriptors as pair_extents, without its sorts).
            ps = expand(s_ids, p.physical_per_logical)
            pd = expand(d_ids, d.physical_per_logical)
            sa, da, ln = coalesce_equal(
                lr.base_addr + ps * lr.block_len, rr.base_addr + pd * rr.block_len, lr.block_len
            )
        elif pair.whole:
            sa, da, ln = pair_extents(
                extents(lr, expand(s_ids, p.physical_per_logical)),
                extents(rr, expand(d_ids, d.physical_per_logical)),
            )
        else:
            sa, da, ln = _segment_pieces(p, d, lr, rr, pair.segments, s_ids, d_ids)
        pieces.append((sa, da, ln, lr.device_id, rr.device_id))
    return _rows(pieces)


def _uniform(p: KVLayout, d: KVLayout, pairs: Sequence[RegionPair]) -> bool:
    """Every pair moves whole physical blocks of one size on both sides, from one id group
    into one id group: then all regions' descriptors come from one set of array operations."""
    if p.physical_per_logical != d.physical_per_logical or not pairs:
        return False
    groups = {(p.regions[x.src].group, d.regions[x.dst].group) for x in pairs}
    return len(groups) == 1 and all(
        x.whole and p.regions[x.src].block_len == d.regions[x.dst].block_len for x in pairs
    )


def _uniform_descs(
    p: KVLayout,
    d: KVLayout,
    pairs: Sequence[RegionPair],
    s_ids: Sequence[int] | np.ndarray,
    d_ids: Sequence[int] | np.ndarray,
) -> tuple[Rows, Rows]:
    """``build_pair_descs`` for ``_uniform`` pairs, rows in pair order. Two pieces of a
    region are contiguous on both sides exactly when their physical ids are consecutive on
    both sides, the same in every region: the runs are found once on the ids, then every
    region's rows come from them at once (a per-region loop costs a dozen numpy calls per
    layer, which a many-layer model would pay at every push)."""
    if len(s_ids) != len(d_ids):
        name = p.regions[pairs[0].src].name
        raise LayoutError(f"region {name}: {len(s_ids)} source blocks, {len(d_ids)} destination")
    if len(pairs) * len(s_ids) * p.physical_per_logical <= SHORT_ROWS:
        return few_uniform_descs(p, d, pairs, s_ids, d_ids)
    s_ids, d_ids = in_source_order(as_ids(s_ids), as_ids(d_ids))
    ps, pd = expand(s_ids, p.physical_per_logical), expand(d_ids, d.physical_per_logical)
    if not ps.size:
        return _rows([])
    cont = (np.diff(ps) == 1) & (np.diff(pd) == 1)  # piece i+1 continues piece i
    if cont.any():
        first = np.flatnonzero(np.concatenate(([True], ~cont)))
        s0, d0 = ps[first], pd[first]
        count = np.diff(np.append(first, ps.size))
    else:  # scattered: every piece is a run of one
        s0, d0, count = ps, pd, np.ones(ps.size, dtype=np.int64)
    col = np.array(
        [
            (lr.base_addr, rr.base_addr, lr.block_len, lr.device_id, rr.device_id)
            for lr, rr in ((p.regions[x.src], d.regions[x.dst]) for x in pairs)
        ],
        dtype=np.int64,
    )
    length = col[:, 2:3]
    n = len(pairs) * s0.size
    src, dst = np.empty((n, 3), dtype=np.int64), np.empty((n, 3), dtype=np.int64)
    src[:, 0] = (col[:, 0:1] + s0 * length).ravel()
    dst[:, 0] = (col[:, 1:2] + d0 * length).ravel()
    src[:, 1] = dst[:, 1] = (count * length).ravel()
    src[:, 2] = np.repeat(col[:, 3], s0.size)
    dst[:, 2] = np.repeat(col[:, 4], s0.size)
    return src, dst


PIECE_COLUMNS = (
    "src_base", "dst_base", "src_stride", "dst_stride", "src_off", "dst_off", "length",
    "src_group", "dst_group",
)  # fmt: skip


def block_pieces(p: KVLayout, d: KVLayout, pairs: Sequence[RegionPair]) -> np.ndarray:
    """Kx9 int64 rows (see PIECE_COLUMNS): what a WRITE moves, per logical block id.

    For the i-th ids ``s`` of group ``src_group`` and ``t`` of ``dst_group``, row k moves
    ``length`` bytes from ``src_base + s * src_stride + src_off`` to ``dst_base + t *
    dst_stride + dst_off``: the same bytes as ``build_pair_descs``, described once per
    peer instead of once per block (a kernel expands them; see core/peer_copy.py).
    """
    rp, rd = p.physical_per_logical, d.physical_per_logical
    rows = []
    for pair in pairs:
        lr, rr = p.regions[pair.src], d.regions[pair.dst]
        head = (lr.base_addr, rr.base_addr, lr.block_len * rp, rr.block_len * rd)
        groups = (lr.group, rr.group)
        if pair.whole:  # a logical block is contiguous on both sides, whatever the split
            rows.append((*head, 0, 0, p.logical_bytes(pair.src), *groups))
            continue
        for k in range(rp):  # segments lie in every physical block (equal splits here)
            for seg in pair.segments:
                offs = (k * lr.block_len + seg.src_off, k * rr.block_len + seg.dst_off)
                rows.append((*head, *offs, seg.length, *groups))
    return np.array(rows, dtype=np.int64).reshape(-1, len(PIECE_COLUMNS))


def _rows(
    pieces: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """Fill the two Nx3 descriptor arrays in place (cheaper than stacking per region)."""
    n = sum(len(sa) for sa, *_ in pieces)
    src, dst = np.empty((n, 3), dtype=np.int64), np.empty((n, 3), dtype=np.int64)
    at = 0
    for sa, da, ln, s_dev, d_dev in pieces:
        end = at + len(sa)
        src[at:end, 0], src[at:end, 1], src[at:end, 2] = sa, ln, s_dev
        dst[at:end, 0], dst[at:end, 1], dst[at:end, 2] = da, ln, d_dev
        at = end
    return src, dst


def _segment_pieces(
    p: KVLayout,
    d: KVLayout,
    lr: Region,
    rr: Region,
    segs: Sequence[Segment],
    s_ids: np.ndarray,
    d_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ps = expand(s_ids, p.physical_per_logical)
    pd = expand(d_ids, d.physical_per_logical)
    so = np.array([s.src_off for s in segs], dtype=np.int64)
    do = np.array([s.dst_off for s in segs], dtype=np.int64)
    ln = np.array([s.length for s in segs], dtype=np.int64)
    # Block-major, segment-minor: consecutive pieces are adjacent whenever both sides are.
    sa = (lr.base_addr + ps[:, None] * lr.block_len + so[None, :]).ravel()
    da = (rr.base_addr + pd[:, None] * rr.block_len + do[None, :]).ravel()
    return coalesce(sa, da, np.tile(ln, len(ps)))
