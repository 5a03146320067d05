"""CudaPeerCopy: the core's PeerCopyHook over CUDA IPC (see kvpush/core/peer_copy.py).

Each worker exports CUDA IPC handles of the allocations behind its KV tensors,
with their base addresses and a host identity. P, on its first transfer to a
peer on the same host, opens the peer's handles (mapping D's KV memory into its
own address space, peer access enabled lazily for another GPU) and from then on
moves a transfer with ONE kernel, one pass over the bytes, on its own stream.
The kernel reads the block ids and the per-peer ``block_pieces`` rows and
computes every address itself, so the host uploads ids, not a descriptor per
block. ``prepare`` (when D registers) builds the kernel's table with D's ids in
pinned memory; ``launch`` (when P's blocks are ready) adds P's ids and launches.

With a word of D's completion lane (core/lane.py) the copy writes the word once
every byte has landed, and P does not wait: ``finished`` reads the word (or asks
the stream). A small copy writes it from its own last thread block (a grid-wide
count); a large one has a one-thread kernel queued right behind it on the stream
(per-block fences would slow its bulk). Without a word, P waits for the kernel
and the core sends the completion. Between two GPUs, ``prepare`` first wakes a
link that carried nothing for ``WAKE_AFTER_S`` (1 MiB into the peer's exported
scratch: an idle NVLink moves its first MiB ~20x slower). A peer on another
host, a mapping that fails or a block outside what the peer exported is declined: the
core WRITEs instead.

Trust: a peer that completed the handshake may write into these allocations,
as NIXL's metadata already lets it (use ``shared_secret`` on shared hosts).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import logging
import os
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.lane import LaneView, host_identity
from kvpush.core.peer_copy import CopyDst, Signal
from kvpush.gpu.copy import COPY_RANGE
from kvpush.gpu.driver import Driver, function_of, handle

log = logging.getLogger(__name__)


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


def _handle_of(kernel: Any) -> Any:
    func = function_of(kernel)
    return None if func is None else handle(func)


class CudaPeerCopy:
    """Export our KV allocations; copy into a same-host peer's with one kernel."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.device = tensors[0].device
        if self.device.type != "cuda":
            raise LayoutError("peer copy needs CUDA tensors")
        import cupy
        import torch

        self._cupy = cupy
        self._dev = int(self.device.index or 0)
        self._drv = Driver(params=8)
        spans: dict[int, int] = {}
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # the context is current on this thread
            for t in tensors:
                base, size = self._drv.allocation_range(int(t.data_ptr()))
                spans[base] = size
            with cupy.cuda.Device(self._dev):
                exported = [
                    Span(b, n, bytes(cupy.cuda.runtime.ipcGetMemHandle(b)))
                    for b, n in sorted(spans.items())
                ]
            # The scratch peers write to wake the link (an allocation of its own).
            self._scratch = int(cupy.cuda.runtime.malloc(WAKE_BYTES))
            handle_ = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._scratch))
            wake = Span(self._scratch, WAKE_BYTES, handle_)
            self._pci = str(cupy.cuda.runtime.deviceGetPCIBusId(self._dev))
        self._export = msgspec.msgpack.encode(Exported(host_identity(), exported, wake, self._pci))
        with cupy.cuda.Device(self._dev):
            module = cupy.RawModule(code=_KERNEL)
            self._kernel = module.get_function("kvpush_piece_copy")
            self._signal = module.get_function("kvpush_lane_word")
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._counter = cupy.zeros(1, dtype=cupy.uint64)  # fused copies' blocks done, ever
            self._counter_at = int(self._counter.data.ptr)
            # The CUfunctions, to launch through the driver (None: through CuPy).
            self._func = _handle_of(self._kernel)
            self._signal_func = _handle_of(self._signal)
        self._stream = int(self.stream.ptr)
        self._stream_h = handle(self._stream)
        self._counted = 0  # thread blocks of fused copies launched, ever
        # Diagnostics (benchmarks): CUDA events around each single-group copy kernel.
        self._timed = os.environ.get("KVPUSH_COPY_EVENTS") == "1"
        self._bound = 0  # the thread the device was made current on
        self.times: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=64))
        self.peers: dict[str, _Mapped | None] = {}  # None: this peer is declined
        self._opened: dict[str, list[int]] = {}
        self.stats: Counter[str] = Counter()

    def export(self) -> bytes:
        return self._export

    # ---- the hook ----------------------------------------------------------------------------

    def prepare(self, peer: str, exported: bytes, dst: CopyDst) -> _Prepared | None:
        if peer not in self.peers:
            self.peers[peer] = self._open(peer, exported)
        mapped = self.peers[peer]
        if mapped is None or len(dst.pieces) > MAX_ROWS:
            return None
        route = mapped.route
        if route is None or route.pieces is not dst.pieces:  # once per peer, in practice
            route = mapped.route = _Route(mapped, dst.pieces)
        if not route.fits(dst):
            self.stats["outside_export"] += 1
            log.warning("a block of %s lies outside what it exported; writing instead", peer)
            return None
        n = 10 * len(dst.pieces) + 2 * sum(len(g) for g in dst.dst)  # src counts match dst's
        mem = self._cupy.cuda.alloc_pinned_memory(max(8, n * 8))
        prep = _Prepared(mapped, route, dst, mem, np.frombuffer(mem, dtype=np.int64, count=n))
        if dst.signal is not None:
            self._signal_to(prep, mapped, dst.signal)
        if route.single:
            prep.src_at = route.head_for(prep.table, dst)
            prep.ids = prep.table.data.cast("B").cast("q")[prep.src_at :][: prep.n]
            if self._func is not None:
                self._build_args(prep)
        now = time.perf_counter()
        if mapped.wake is not None and now - mapped.used > WAKE_AFTER_S:
            self._wake(mapped.wake[1])
        mapped.used = now
        return prep

    def _wake(self, table: int) -> None:
        """WAKE_BYTES from our scratch into the peer's: the link is fast when the copy
        comes. Queued on the copy stream, so a copy launched meanwhile follows it (and
        would have paid the slow link itself). Best effort: a failure changes nothing."""
        try:
            self._bind()
            grid = (WAKE_BYTES // TILE, 1)
            self._launch(self._func, self._kernel, grid, (table, table + 80, TILE, 1, 0, 0, 0, 0))
            self.stats["wakes"] += 1
        except Exception as e:  # the copy itself reports any real failure
            log.warning("waking the link failed: %s", e)

    def _bind(self) -> None:
        if self._bound != threading.get_ident():  # once per thread: fewer CUDA calls per copy
            self._cupy.cuda.runtime.setDevice(self._dev)
            self._bound = threading.get_ident()

    def launch(self, prepared: object, src: Sequence[Any], after: object = None) -> bool:
        prep = prepared
        assert isinstance(prep, _Prepared)
        if not prep.n or not len(prep.dst.pieces):
            return False  # nothing to move
        if prep.argv is not None:
            return self._launch_ready(prep, src[0], after)
        t0 = prep.mapped.used = time.perf_counter()
        route, table = prep.route, prep.table
        if prep.src_at >= 0:
            table[prep.src_at : prep.src_at + prep.n] = src[0]
            most = prep.n
        else:
            need = table_len(prep.dst.pieces, src, prep.dst.dst)
            if need > len(table):  # P has more groups than D: the general table is longer
                prep.mem = self._cupy.cuda.alloc_pinned_memory(need * 8)
                table = prep.table = np.frombuffer(prep.mem, dtype=np.int64, count=need)
                prep.ptr = -1
            most = route.fill(table, prep.dst, src)
        grid = (most * route.tiles, len(route.head))
        if grid[0] > MAX_GRID_X:
            raise LayoutError(f"{most} blocks of {route.tiles} tiles exceed one launch")
        self._bind()
        if after is not None:
            self._follow(after)
        word = (prep.word, prep.gen)
        ptr = prep.ptr
        if ptr < 0:  # the table was grown at this launch
            ptr = prep.ptr = int(table.ctypes.data)
        t1 = time.perf_counter()
        args = (ptr, ptr + 80 * grid[1], TILE, route.tiles)
        blocks = grid[0] * grid[1]
        if prep.word and blocks <= FUSED_MAX_BLOCKS:  # the copy's last block writes the word
            target = self._counted + blocks
            self._launch(self._func, self._kernel, grid, (*args, self._counter_at, target, *word))
            self._counted = target
        else:
            self._launch(self._func, self._kernel, grid, (*args, 0, 0, 0, 0))
            if prep.word:  # right behind the copy on the stream: D's word
                self._launch(self._signal_func, self._signal, (1, 1), word)
        return self._launched(prep, t0, t1)

    def _launch_ready(self, prep: _Prepared, ids: Any, after: object = None) -> bool:
        """A single-group copy whose arguments ``prepare`` built: ids in, one launch."""
        t0 = time.perf_counter()
        if type(ids) is array.array and ids.typecode == "q":  # as single_src packs lists
            prep.ids[:] = ids  # one memcpy into the pinned table
        else:
            prep.table[prep.src_at : prep.src_at + prep.n] = ids
        self._bind()
        if prep.blocks:
            self._counted += prep.blocks
            prep.args[5] = self._counted
        if after is not None:
            self._follow(after)
        t1 = time.perf_counter()
        if self._timed:
            prep.events = (self._cupy.cuda.Event(), self._cupy.cuda.Event())
            prep.events[0].record(self.stream)
        self._drv.launch(self._func, prep.grid, THREADS, self._stream_h, prep.argv)
        if prep.word and not prep.blocks:  # right behind the copy on the stream: D's word
            self._launch(self._signal_func, self._signal, (1, 1), (prep.word, prep.gen))
        if self._timed:
            prep.events[1].record(self.stream)
        prep.mapped.used = t0
        return self._launched(prep, t0, t1)

    def _follow(self, after: Any) -> None:
        """Queue what comes next on the copy stream behind ``after``: a torch or CuPy CUDA
        event of this device (its handle is ``cuda_event`` or ``ptr``); anything else that
        the core accepts (``synchronize()``) is waited for here."""
        event = getattr(after, "cuda_event", None) or getattr(after, "ptr", None)
        if isinstance(event, int) and event:
            self._drv.wait_event(self._stream_h, event)
            self.stats["follows"] += 1
        else:
            after.synchronize()

    def _launched(self, prep: _Prepared, t0: float, t1: float) -> bool:
        """After a launch: its times; True with a lane word (never waits: without one,
        the producer polls ``finished`` and then notifies)."""
        t2 = time.perf_counter()
        self.stats["copies"] += 1
        self.times["table"].append((t1 - t0) * 1e6)
        self.times["launch"].append((t2 - t1) * 1e6)
        return bool(prep.word)

    def _build_args(self, prep: _Prepared) -> None:
        route = prep.route
        rows = len(route.head)
        grid = (prep.n * route.tiles, rows)
        if grid[0] > MAX_GRID_X:
            return  # launch() says why
        prep.grid = grid
        fused = prep.word and grid[0] * rows <= FUSED_MAX_BLOCKS
        prep.blocks = grid[0] * rows if fused else 0
        word = (self._counter_at, 0, prep.word, prep.gen) if fused else (0, 0, 0, 0)
        prep.args, prep.argv = self._drv.arguments(
            (prep.ptr, prep.ptr + 80 * rows, TILE, route.tiles, *word)
        )

    def finished(self, prepared: object) -> bool:
        prep = prepared
        assert isinstance(prep, _Prepared)
        if prep.lane is not None and prep.lane[prep.slot] == prep.gen:
            done = True
        else:
            done = self._drv.done(self._stream)
        if done and prep.events is not None:  # diagnostics: the kernel's own time
            start, end = prep.events
            prep.events = None
            end.synchronize()
            self.times["kernel"].append(self._cupy.cuda.get_elapsed_time(start, end) * 1e3)
        return done

    def forget(self, peer: str) -> None:
        mapped = self.peers.pop(peer, None)
        opened = self._opened.pop(peer, [])
        if opened or (mapped is not None and mapped.lane is not None):
            with contextlib.suppress(Exception):  # no copy may still write into the mapping
                self._drv.wait(self._stream)
        if mapped is not None and mapped.lane is not None:
            view, _ = mapped.lane
            with contextlib.suppress(Exception):
                self._drv.unmap_host(view.address())
            view.close()
        self._close(opened)

    def close(self) -> None:
        for peer in list(self.peers):
            self.forget(peer)
        if self._scratch:
            with contextlib.suppress(Exception), self._cupy.cuda.Device(self._dev):
                self._cupy.cuda.runtime.free(self._scratch)
            self._scratch = 0

    def timing_us(self) -> dict[str, float]:
        """Median microseconds of the copy's host stages over the last copies."""
        return {k: float(np.median(v)) for k, v in self.times.items() if v}

    # ---- internals ---------------------------------------------------------------------------

    def _launch(self, func: Any, kernel: Any, grid: tuple[int, int], args: tuple[int, ...]) -> None:
        threads = THREADS if grid != (1, 1) else 1
        if func is None:  # this CuPy hides the CUfunction: its own (slower) launch
            with self.stream:
                kernel(grid, (threads,), tuple(np.uint64(a) for a in args))
            return
        self._drv.args[: len(args)] = args  # type: ignore[call-overload]
        self._drv.launch(func, grid, threads, self._stream_h)

    def _signal_to(self, prep: _Prepared, mapped: _Mapped, signal: Signal) -> None:
        """Point the copy at D's lane word; without a usable lane it is waited for."""
        if mapped.lane_failed:
            return
        if mapped.lane is None:
            try:
                view = LaneView(signal.lane)
                with self._cupy.cuda.Device(self._dev):
                    mapped.lane = (view, self._drv.map_host(view.address(), view.slots * 8))
            except Exception as e:  # another user's file, no /dev/shm, not registrable
                self.stats["lane_failed"] += 1
                mapped.lane_failed = True
                log.warning("cannot map lane %s (%s); completions go over NIXL", signal.lane, e)
                return
        view, dev = mapped.lane
        if not 0 <= signal.slot < view.slots:
            self.stats["lane_bad_slot"] += 1
            log.warning("lane word %d outside %s; completion over NIXL", signal.slot, signal.lane)
            return
        prep.word, prep.gen = dev + 8 * signal.slot, signal.gen
        prep.lane, prep.slot = view.words, signal.slot

    def _open(self, peer: str, exported: bytes) -> _Mapped | None:
        try:
            info = msgspec.msgpack.decode(exported, type=Exported)
        except msgspec.DecodeError as e:
            log.warning("peer %s exported undecodable memory: %s", peer, e)
            return None
        if info.host != host_identity():
            self.stats["other_host"] += 1
            return None
        rt = self._cupy.cuda.runtime
        opened: list[int] = []
        try:
            with self._cupy.cuda.Device(self._dev):
                lazy = rt.cudaIpcMemLazyEnablePeerAccess
                spans = []
                for s in info.spans:
                    opened.append(int(rt.ipcOpenMemHandle(s.handle, lazy)))
                    # Bounds come from what was mapped, not from what the peer claims.
                    base, size = self._drv.allocation_range(opened[-1])
                    if base != opened[-1] or size < s.size:
                        raise LayoutError(f"peer claims {s.size} bytes, {size} are mapped")
                    spans.append(s)
        except Exception as e:  # not peer-accessible, same process, handle gone, ...
            self.stats["open_failed"] += 1
            log.warning("cannot map the memory of %s (%s); writing instead", peer, e)
            self._close(opened)
            return None
        mapped = _Mapped(spans, opened)
        if info.wake is not None and info.device and info.device != self._pci:
            mapped.wake = self._map_wake(info.wake, opened)
        self._opened[peer] = opened
        self.stats["mapped"] += 1
        log.info("mapped %d allocations of %s for direct copies", len(opened), peer)
        return mapped

    def _map_wake(self, span: Span, opened: list[int]) -> tuple[Any, int] | None:
        """The kernel table that wakes the link to a peer on another GPU (None: its
        scratch cannot be mapped)."""
        rt = self._cupy.cuda.runtime
        try:
            with self._cupy.cuda.Device(self._dev):
                at = int(rt.ipcOpenMemHandle(span.handle, rt.cudaIpcMemLazyEnablePeerAccess))
                opened.append(at)  # closed with the peer's other mappings
                base, size = self._drv.allocation_range(at)
                if base != at or size < WAKE_BYTES:
                    raise LayoutError(f"wake scratch of {size} bytes")
        except Exception as e:  # copies still work; the first one may be slower
            log.warning("no link wake-up for this peer (%s)", e)
            return None
        n = WAKE_BYTES // TILE
        mem = self._cupy.cuda.alloc_pinned_memory(8 * (10 + 2 * n))
        table = np.frombuffer(mem, dtype=np.int64, count=10 + 2 * n)
        # One row: our scratch's tiles onto the peer's, ids 0..n-1 each side.
        table[:10] = [self._scratch, at, TILE, TILE, 0, 0, TILE, n, 0, n]
        table[10:] = list(range(n)) * 2
        return mem, int(table.ctypes.data)

    def _close(self, opened: list[int]) -> None:
        with self._cupy.cuda.Device(self._dev):
            for at in opened:
                with contextlib.suppress(Exception):
                    self._cupy.cuda.runtime.ipcCloseMemHandle(at)


def make_peer_copy(mode: str, tensors: Sequence[Any]) -> CudaPeerCopy | None:
    """The hook for ``mode`` ("auto": when the caches are CUDA tensors and CuPy imports;
    "on": the same, or an error; "off": None)."""
    if mode == "off" or not tensors:
        return None
    flat = [
        t for group in tensors for t in (group if isinstance(group, (list, tuple)) else [group])
    ]
    if any(t.device.type != "cuda" for t in flat):
        if mode == "on":
            raise LayoutError("peer_copy=on needs KV caches on CUDA devices")
        return None
    try:
        return CudaPeerCopy(flat)
    except Exception as e:  # no CuPy, or memory that cannot be exported (VMM allocations)
        if mode == "on":
            raise
        log.warning("peer copy off (%s: %s); NIXL WRITEs only", type(e).__name__, e)
        return None
