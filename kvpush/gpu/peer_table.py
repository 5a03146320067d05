"""The kernel of CudaPeerCopy (peer_copy.py) and what it keeps per peer and per copy.

``Span`` and ``Exported`` are what a worker exports; ``_Mapped`` is a peer's exported
memory as opened here, ``_Route`` the kernel's rows for one peer's ``block_pieces``,
``_Prepared`` one copy waiting for P's ids. ``fill_table`` writes the table the kernel
reads (its layout is in the kernel's comment).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvpush.core.lane import LaneView
from kvpush.core.peer_copy import CopyDst
from kvpush.gpu.copy import COPY_RANGE


class Span(msgspec.Struct, array_like=True, frozen=True):
    base: int  # the allocation's address in the exporting process
    size: int
    handle: bytes  # cudaIpcMemHandle_t


class Exported(msgspec.Struct, frozen=True):
    host: str
    spans: list[Span]
    wake: Span | None = None  # scratch a peer on another GPU may write to wake the link
    device: str = ""  # the exporter's GPU (PCI bus id)


_KERNEL = (
    COPY_RANGE
    + r"""
extern "C" __global__ void kvpush_piece_copy(const long long* __restrict__ table,
                                             const long long* __restrict__ ids,
                                             long long tile, long long tiles,
                                             unsigned long long* counter,
                                             unsigned long long target,
                                             unsigned long long* word,
                                             unsigned long long gen) {
    // Row blockIdx.y: src base, dst base, src stride, dst stride, src off, dst off,
    // length, offset of its src ids, offset of its dst ids, count.
    const long long* p = table + 10LL * blockIdx.y;
    long long i = blockIdx.x / tiles, start = (blockIdx.x % tiles) * tile;
    long long len = p[6];
    if (i < p[9] && start < len) {
        long long n = len - start < tile ? len - start : tile;
        kvpush_copy_range((unsigned long long)(p[0] + ids[p[7] + i] * p[2] + p[4] + start),
                          (unsigned long long)(p[1] + ids[p[8] + i] * p[3] + p[5] + start), n);
    }
    if (word != 0) {
        // Small copies signal from the kernel itself (one launch fewer): each block's
        // stores are visible system-wide before it is counted (a per-block cost that
        // large copies avoid with kvpush_lane_word), and the block completing the
        // count writes D's word after one more fence.
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            if (atomicAdd(counter, 1ULL) + 1ULL == target) {
                __threadfence_system();
                *reinterpret_cast<volatile unsigned long long*>(word) = gen;
            }
        }
    }
}

// Launched after a large copy on its stream: every byte of the copy is in place (stream
// order) and, past the fence, visible to the host and to D's device before the word is.
extern "C" __global__ void kvpush_lane_word(unsigned long long* word, unsigned long long gen) {
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(word) = gen;
}
"""
)
THREADS = 256
TILE = 64 << 10  # bytes per thread block: long pages are cut so the grid fills the GPU
MAX_ROWS = 65535  # grid y
MAX_GRID_X = (1 << 31) - 1
FUSED_MAX_BLOCKS = 512  # copies of up to this many thread blocks write the lane word themselves
# NVLink between two idle GPUs runs slow for its first ~MiB (measured: 16 x 64 KiB took
# ~175 us after 100 ms idle, ~10 us after 20 ms; scripts/gpu_probe.py). When a copy to a
# peer on another GPU is prepared and that link has been idle this long, P writes
# WAKE_BYTES into the peer's scratch (its own, not KV) while the prefill still runs.
WAKE_AFTER_S = 10e-3
WAKE_BYTES = 1 << 20


def table_len(pieces: np.ndarray, src: Sequence[Any], dst: Sequence[Any]) -> int:
    return 10 * len(pieces) + sum(len(g) for g in src) + sum(len(g) for g in dst)


def fill_table(
    out: np.ndarray,
    pieces: np.ndarray,
    dst_base: np.ndarray,
    src: Sequence[Any],
    dst: Sequence[Any],
) -> int:
    """Write the kernel's K x 10 table, then every id, into ``out``; return max(count)."""
    k = len(pieces)
    table = out[: 10 * k].reshape(k, 10)
    ids = [*src, *dst]
    starts = 10 * k + np.cumsum([0] + [len(g) for g in ids])
    table[:, :7] = pieces[:, :7]
    table[:, 1] = dst_base
    table[:, 7] = starts[pieces[:, 7]] - 10 * k  # offsets from the first id
    table[:, 8] = starts[len(src) + pieces[:, 8]] - 10 * k
    counts = np.array([len(g) for g in src], dtype=np.int64)[pieces[:, 7]]
    table[:, 9] = counts
    for g, at in zip(ids, starts.tolist(), strict=False):
        out[at : at + len(g)] = g
    return int(counts.max()) if k else 0


class _Mapped:
    """A peer's exported spans, opened here: remote base -> local address."""

    def __init__(self, spans: Sequence[Span], local: Sequence[int]) -> None:
        order = np.argsort([s.base for s in spans])
        self.remote = [spans[i].base for i in order]
        self.sizes = [spans[i].size for i in order]
        self.local = [local[i] for i in order]
        self.route: _Route | None = None  # for the pieces of the last copy
        self.lane: tuple[LaneView, int] | None = None  # the peer's lane and its device address
        self.lane_failed = False  # mapping it failed once: this peer's copies are waited for
        self.wake: tuple[Any, int] | None = None  # another GPU: (pinned table, its address)
        self.used = 0.0  # perf_counter of the last copy prepared or launched into it


class _Route:
    """What every copy to one peer with the same ``block_pieces`` rows reuses.

    ``head`` holds the kernel's rows with D's bases already translated to our mapping
    (columns 7-9 change per copy); ``max_id[g]`` is the largest id of D's group g whose
    bytes stay inside the span its id 0 lies in (-1: none do), so a copy only compares
    D's ``dst_max`` with it.
    """

    def __init__(self, mapped: _Mapped, pieces: np.ndarray) -> None:
        self.pieces = pieces
        k = len(pieces)
        self.head = np.zeros((k, 10), dtype=np.int64)
        self.head[:, :7] = pieces[:, :7]
        groups = int(pieces[:, 8].max()) + 1 if k else 0
        self.max_id = [1 << 62] * groups
        for r, row in enumerate(pieces.tolist()):
            base, stride, off, length, g = row[1], row[3], row[5], row[6], row[8]
            lo = base + off
            i = bisect.bisect_right(mapped.remote, lo) - 1
            end = mapped.remote[i] + mapped.sizes[i] if i >= 0 else lo
            fit = (end - lo - length) // stride if end >= lo + length else -1
            self.max_id[g] = min(self.max_id[g], fit)
            self.head[r, 1] = base + (mapped.local[i] - mapped.remote[i] if i >= 0 else 0)
        # One group each side: every row reads src ids n..2n-1 and dst ids 0..n-1.
        self.single = k > 0 and not pieces[:, 7:9].any()
        self.tiles = -(-int(pieces[:, 6].max()) // TILE) if k else 1

    def fits(self, dst: CopyDst) -> bool:
        return all(m <= self.max_id[g] for g, m in enumerate(dst.dst_max) if m >= 0)

    def head_for(self, out: np.ndarray, dst: CopyDst) -> int:
        """Single group: the rows and D's ids into ``out``; returns where P's ids go."""
        n, k10 = len(dst.dst[0]), 10 * len(self.head)
        table = out[:k10].reshape(-1, 10)
        table[:] = self.head
        table[:, 7] = n  # P's ids follow D's n ids
        table[:, 8] = 0
        table[:, 9] = n
        out[k10 : k10 + n] = dst.dst[0]
        return k10 + n

    def fill(self, out: np.ndarray, dst: CopyDst, src: Sequence[Any]) -> int:
        """The whole table for ``src`` into ``dst``; returns the largest count."""
        return fill_table(out, dst.pieces, self.head[:, 1], src, dst.dst)


class _Prepared:
    """One copy, ready but for P's ids; its pinned table lives as long as it does."""

    __slots__ = (
        *("route", "dst", "mem", "table", "ptr", "src_at", "n"),
        *("word", "gen", "lane", "slot", "args", "argv", "grid", "blocks", "events", "mapped"),
        "ids",
    )

    def __init__(
        self, mapped: _Mapped, route: _Route, dst: CopyDst, mem: Any, table: np.ndarray
    ) -> None:
        self.mapped, self.route, self.dst, self.mem, self.table = mapped, route, dst, mem, table
        self.ptr = int(table.ctypes.data)  # pinned memory is mapped for the device (UVA)
        self.src_at = -1  # single group: where P's ids go (-1: the whole table at launch)
        self.ids: Any = None  # single group: P's ids in the table, as int64 ("q")
        self.n = sum(len(g) for g in dst.dst)  # blocks D receives (single group: its ids)
        self.word = 0  # the device address of D's lane word (0: no signal)
        self.gen = 0
        self.lane: Any = None  # the lane's words, as mapped here: finished() reads ours
        self.slot = 0
        # Single group: the kernel's arguments, built here so a launch only sets the
        # fused copy's count target (None: built at launch).
        self.args: Any = None
        self.argv: Any = None
        self.grid = (0, 0)
        self.blocks = 0  # thread blocks of a fused copy (0: the word is a kernel of its own)
        self.events: Any = None  # KVPUSH_COPY_EVENTS=1: CUDA events around the kernel
