"""KV memory described as typed regions, and the WRITE descriptors between two layouts.

A region is one contiguous allocation (for example the K cache of one layer)
holding ``num_blocks`` physical blocks of ``block_len`` bytes each. Schedulers
speak *logical* block ids; each logical block is ``physical_per_logical``
consecutive physical blocks. Descriptors are built in bytes, so P and D may use
different physical block sizes as long as a logical block holds the same bytes.
Contiguous runs on both sides become one descriptor.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError

MemType = Literal["DRAM", "VRAM"]
Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class PackedMember(msgspec.Struct, array_like=True, frozen=True):
    """Where one layer's page sits in a packed (block-outermost) row."""

    layer: str
    offset: NonNeg
    page_len: Pos


class Region(msgspec.Struct, frozen=True):
    """One registered allocation: ``num_blocks`` blocks of ``block_len`` bytes each.

    ``layers`` names the layers whose KV lives here (several when pooled, as with
    a hybrid allocator; empty means just ``name``). ``kv_heads`` > 0 says each block
    holds that many KV heads head-major (head h at h * block_len / kv_heads), so a
    peer of another TP size can address a head slice; 0 means the block is opaque
    (MLA pages, replicated on every rank). ``packed`` lists the layers of a packed
    row (all layers of a block in one row of ``block_len`` bytes).
    """

    name: str
    base_addr: NonNeg
    block_len: Pos
    num_blocks: Pos
    device_id: NonNeg = 0
    group: NonNeg = 0  # KV-cache group whose block ids index this region
    layers: list[str] = msgspec.field(default_factory=list)
    kv_heads: NonNeg = 0
    packed: list[PackedMember] = msgspec.field(default_factory=list)

    @property
    def members(self) -> list[str]:
        if self.packed:
            return [m.layer for m in self.packed]
        return self.layers or [self.name]

    @property
    def nbytes(self) -> int:
        return self.block_len * self.num_blocks


class KVLayout(msgspec.Struct, frozen=True):
    """Everything a peer needs to know about our KV memory."""

    regions: list[Region]
    block_size: Pos  # tokens per logical block
    physical_per_logical: Pos = 1
    mem_type: MemType = "DRAM"
    tp_rank: NonNeg = 0
    tp_size: Pos = 1
    pp_rank: NonNeg = 0
    pp_size: Pos = 1
    attention: Literal["standard", "mla"] = "standard"
    backends: list[str] = msgspec.field(default_factory=list)  # attention backend names
    mamba: bool = False  # holds SSM state besides attention KV

    def logical_bytes(self, region: int) -> int:
        return self.regions[region].block_len * self.physical_per_logical

    def num_logical_blocks(self, group: int = 0) -> int:
        counts = [r.num_blocks for r in self.regions if r.group == group]
        if not counts:
            raise LayoutError(f"no region belongs to group {group}")
        return min(counts) // self.physical_per_logical

    @property
    def groups(self) -> int:
        return 1 + max(r.group for r in self.regions)


@dataclass(frozen=True)
class Segment:
    """Bytes ``[src_off, src_off + length)`` of a P block go to ``dst_off`` of a D block."""

    src_off: int
    dst_off: int
    length: int


@dataclass(frozen=True)
class RegionPair:
    """P's region ``src`` into D's region ``dst`` (made by routing.pair_regions)."""

    src: int  # index of P's region
    dst: int  # index of D's region
    whole: bool  # the whole logical block (any physical split); else ``segments``
    segments: tuple[Segment, ...] = ()


SHORT_IDS = 256  # up to this many ids, builtins beat numpy's per-call cost


def packed_ids(ids: Sequence[int]) -> array.array[int]:
    """Block ids packed as int64 (array.array converts a list ~1.5x faster than numpy);
    LayoutError unless every one is an int."""
    try:
        return array.array("q", ids)
    except (TypeError, OverflowError) as e:
        raise LayoutError(f"block ids must be integers: {e}") from e


def as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as an int64 array; one already is comes back as is (no copy)."""
    if isinstance(ids, np.ndarray):
        return ids if ids.dtype == np.int64 else ids.astype(np.int64)
    return np.frombuffer(packed_ids(ids), dtype=np.int64)


def id_range(ids: np.ndarray | array.array[int] | list[int]) -> tuple[int, int]:
    """(lowest, highest) of non-empty ids: builtins on short lists (a numpy reduction
    costs microseconds, more on the cold caches at the end of a prefill), numpy on long."""
    if isinstance(ids, list):
        return min(ids), max(ids)
    if len(ids) <= SHORT_IDS:
        vals = ids.tolist()
        return min(vals), max(vals)
    arr = ids if isinstance(ids, np.ndarray) else np.frombuffer(ids, dtype=np.int64)
    return int(arr.min()), int(arr.max())


def group_limits(layout: KVLayout) -> list[int]:
    """Logical blocks per group: what ids of each group must stay below (0: no region)."""
    counts: list[list[int]] = [[] for _ in range(layout.groups)]
    for r in layout.regions:
        counts[r.group].append(r.num_blocks)
    return [min(c) // layout.physical_per_logical if c else 0 for c in counts]


def validate_block_ids(
    layout: KVLayout | Sequence[int],
    groups: Sequence[Sequence[int] | np.ndarray],
    unique_known: bool = False,
) -> list[int]:
    """Raise LayoutError if the logical ids do not fit ``layout`` (range, duplicates, groups).

    ``layout`` may be given as its ``group_limits`` (computed once per peer).
    ``unique_known``: the ids were checked for duplicates already (a decoded PUSH_REG).
    Returns the largest id of each group (-1 when empty).
    """
    limits = group_limits(layout) if isinstance(layout, KVLayout) else layout
    if len(groups) != len(limits):
        raise LayoutError(f"{len(groups)} block-id groups for a layout of {len(limits)}")
    most = []
    for g, ids in enumerate(groups):
        if not len(ids):
            most.append(-1)
            continue
        arr = _checkable(ids)
        limit = limits[g]
        lo, hi = id_range(arr)
        if hi >= limit or lo < 0:
            raise LayoutError(f"group {g}: block id outside [0, {limit})")
        if not unique_known and _has_duplicates(arr, limit):
            raise LayoutError(f"group {g}: duplicate block ids")
        most.append(hi)
    return most


def _checkable(ids: Sequence[int] | np.ndarray) -> list[int] | np.ndarray:
    """Short: a list of ints, checked with builtins (packing checks a list holds ints);
    long: one int64 array, checked with numpy."""
    if len(ids) > SHORT_IDS:
        return as_ids(ids)
    return as_ids(ids).tolist() if isinstance(ids, np.ndarray) else packed_ids(ids).tolist()


def _has_duplicates(arr: list[int] | np.ndarray, limit: int) -> bool:
    """Ids already known to lie in [0, limit)."""
    if isinstance(arr, list):
        return len(set(arr)) != len(arr)
    if limit <= 64 * arr.size:  # a mark per possible id: cheaper than a sort
        seen = np.zeros(limit, dtype=np.bool_)
        seen[arr] = True
        return int(np.count_nonzero(seen)) != arr.size
    ordered = np.sort(arr)  # (np.unique hashes: ~15x slower on thousands of ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def expand(logical: Sequence[int] | np.ndarray, ratio: int) -> np.ndarray:
    """Logical block ids to physical ones: block b becomes b*ratio .. b*ratio+ratio-1."""
    ids = as_ids(logical)
    if ratio == 1:
        return ids
    return (ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)).ravel()


def in_source_order(s_ids: np.ndarray, d_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (P id, D id) pairs sorted by P's id. An engine that reuses the blocks it freed
    last first (vLLM's allocator, for blocks without a prefix-cache hash) hands a request
    runs of descending ids, on P and on D alike; in P's order those are ascending runs on
    both sides, which merge into one descriptor each. Where the WRITE's pieces land does
    not depend on their order."""
    if len(s_ids) < 2:
        return s_ids, d_ids
    order = np.argsort(s_ids, kind="stable")
    return s_ids[order], d_ids[order]


def extents(region: Region, physical: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coalesced (start address, length) of the given blocks, in list order."""
    if physical.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    breaks = np.flatnonzero(np.diff(physical) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [physical.size]))
    addr = region.base_addr + physical[starts] * region.block_len
    return addr.astype(np.int64), ((ends - starts) * region.block_len).astype(np.int64)


def pair_extents(
    src: tuple[np.ndarray, np.ndarray], dst: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split two extent lists of equal total length at the union of their boundaries.

    Returns (src addresses, dst addresses, lengths): the i-th byte of the source
    stream lands on the i-th byte of the destination stream.
    """
    (s_addr, s_len), (d_addr, d_len) = src, dst
    s_end, d_end = np.cumsum(s_len), np.cumsum(d_len)
    total = int(s_end[-1]) if s_end.size else 0
    if total != (int(d_end[-1]) if d_end.size else 0):
        raise LayoutError("source and destination hold different numbers of bytes")
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    bounds = np.union1d(s_end, d_end)
    starts = np.concatenate(([0], bounds[:-1]))
    si = np.searchsorted(s_end, starts, side="right")
    di = np.searchsorted(d_end, starts, side="right")
    s_off = starts - (s_end[si] - s_len[si])
    d_off = starts - (d_end[di] - d_len[di])
    return s_addr[si] + s_off, d_addr[di] + d_off, bounds - starts


def coalesce(
    sa: np.ndarray, da: np.ndarray, ln: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive pieces that continue contiguously on both sides."""
    if sa.size <= 1:
        return sa, da, ln
    cont = (sa[1:] == sa[:-1] + ln[:-1]) & (da[1:] == da[:-1] + ln[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~cont) + 1))
    return sa[starts], da[starts], np.add.reduceat(ln, starts)


def coalesce_equal(
    sa: np.ndarray, da: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``coalesce`` for pieces all ``length`` bytes long, the common case, in fewer passes."""
    n = sa.size
    if n <= 1:
        return sa, da, np.full(n, length, dtype=np.int64)
    # A piece starts a run unless both sides continue the previous one.
    breaks = np.flatnonzero((np.diff(sa) != length) | (np.diff(da) != length))
    if breaks.size == n - 1:  # nothing merges (scattered): no gathers needed
        return sa, da, np.full(n, length, dtype=np.int64)
    starts = np.empty(breaks.size + 1, dtype=np.int64)
    starts[0] = 0
    starts[1:] = breaks + 1
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = n
    return sa[starts], da[starts], (ends - starts) * length
