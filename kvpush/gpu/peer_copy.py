"""CudaPeerCopy: the core's PeerCopyHook over CUDA IPC (see kvpush/core/peer_copy.py).

Each worker exports CUDA IPC handles of the allocations behind its KV tensors,
with their base addresses and a host identity. P, on its first transfer to a
peer on the same host, opens the peer's handles (mapping D's KV memory into its
own address space, peer access enabled lazily for another GPU) and from then on
moves a transfer with ONE kernel, one pass over the bytes, on its own stream,
waits for it, and lets the core send the completion. The kernel reads the
block ids and the per-peer ``block_pieces`` rows and computes every address
itself, so the host uploads ids, not a descriptor per block. A peer on another
host, a mapping that fails or a block outside what the peer exported is
declined: the core WRITEs instead.

Trust: a peer that completed the handshake may write into these allocations,
as NIXL's metadata already lets it (use ``shared_secret`` on shared hosts).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import os
import socket
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.peer_copy import CopyPlan

log = logging.getLogger(__name__)


class Span(msgspec.Struct, array_like=True, frozen=True):
    base: int  # the allocation's address in the exporting process
    size: int
    handle: bytes  # cudaIpcMemHandle_t


class Exported(msgspec.Struct, frozen=True):
    host: str
    spans: list[Span]


def host_identity() -> str:
    """Same string for every process of one (booted) host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the CUDA allocation holding ``ptr`` (a context must be current)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    fn = cuda.cuMemGetAddressRange_v2
    u64 = ctypes.c_uint64
    fn.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64]
    err = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if err:
        raise LayoutError(f"cuMemGetAddressRange failed ({err}) for {ptr:#x}")
    return int(base.value), int(size.value)


_KERNEL = r"""
extern "C" __global__ void kvpush_piece_copy(const long long* __restrict__ table,
                                             const long long* __restrict__ ids,
                                             long long tile, long long tiles) {
    // Row blockIdx.y: src base, dst base, src stride, dst stride, src off, dst off,
    // length, offset of its src ids, offset of its dst ids, count.
    const long long* p = table + 10LL * blockIdx.y;
    long long i = blockIdx.x / tiles, start = (blockIdx.x % tiles) * tile;
    long long len = p[6];
    if (i >= p[9] || start >= len) return;
    long long n = len - start < tile ? len - start : tile;
    unsigned long long s = (unsigned long long)(p[0] + ids[p[7] + i] * p[2] + p[4] + start);
    unsigned long long d = (unsigned long long)(p[1] + ids[p[8] + i] * p[3] + p[5] + start);
    if (((s | d | (unsigned long long)n) & 15ULL) == 0ULL) {
        const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(s);
        uint4* __restrict__ d4 = reinterpret_cast<uint4*>(d);
        long long n4 = n >> 4, j = threadIdx.x, st = blockDim.x;
        // Eight 16-byte loads in flight per thread before any store: a tile of 64 KiB
        // is two rounds of 256 threads.
        for (; j + 7 * st < n4; j += 8 * st) {
            uint4 r[8];
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = s4[j + k * st];
#pragma unroll
            for (int k = 0; k < 8; k++) d4[j + k * st] = r[k];
        }
        for (; j < n4; j += st) d4[j] = s4[j];
    } else {
        const unsigned char* sb = reinterpret_cast<const unsigned char*>(s);
        unsigned char* db = reinterpret_cast<unsigned char*>(d);
        for (long long j = threadIdx.x; j < n; j += blockDim.x) db[j] = sb[j];
    }
}
"""
THREADS = 256
TILE = 64 << 10  # bytes per thread block: long pages are cut so the grid fills the GPU
MAX_ROWS = 65535  # grid y


def table_len(pieces: np.ndarray, src: Sequence[np.ndarray], dst: Sequence[np.ndarray]) -> int:
    return 10 * len(pieces) + sum(len(g) for g in src) + sum(len(g) for g in dst)


def fill_table(
    out: np.ndarray,
    pieces: np.ndarray,
    dst_base: np.ndarray,
    src: Sequence[np.ndarray],
    dst: Sequence[np.ndarray],
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


class _Route:
    """What every copy to one peer with the same ``block_pieces`` rows reuses.

    ``head`` holds the kernel's rows with D's bases already translated to our mapping
    (columns 7-9 change per copy); ``max_id[g]`` is the largest id of D's group g whose
    bytes stay inside the span its id 0 lies in (-1: none do), so a copy only compares
    the plan's ``dst_max`` with it.
    """

    def __init__(self, mapped: _Mapped, pieces: np.ndarray) -> None:
        self.pieces = pieces
        k = len(pieces)
        self.head = np.zeros((k, 10), dtype=np.int64)
        self.head[:, :7] = pieces[:, :7]
        self.flat = self.head.reshape(-1)  # a view: the bytes copied into the table
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
        # One group each side: every row reads ids 0..n-1 and n..2n-1 of the table.
        self.single = k > 0 and not pieces[:, 7:9].any()
        self.tiles = -(-int(pieces[:, 6].max()) // TILE) if k else 1

    def fits(self, plan: CopyPlan) -> bool:
        return all(m <= self.max_id[g] for g, m in enumerate(plan.dst_max) if m >= 0)

    def fill(self, out: np.ndarray, plan: CopyPlan) -> int:
        """The kernel table for ``plan`` into ``out``; returns the largest count."""
        if not self.single:
            return fill_table(out, plan.pieces, self.head[:, 1], plan.src, plan.dst)
        n, k10 = len(plan.src[0]), len(self.flat)
        self.head[:, 8:] = n  # dst ids follow the n src ids; n blocks per row
        out[:k10] = self.flat
        out[k10 : k10 + n] = plan.src[0]
        out[k10 + n : k10 + 2 * n] = plan.dst[0]
        return n


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
        spans: dict[int, int] = {}
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # the context is current on this thread
            for t in tensors:
                base, size = allocation_range(int(t.data_ptr()))
                spans[base] = size
            with cupy.cuda.Device(self._dev):
                exported = [
                    Span(b, n, bytes(cupy.cuda.runtime.ipcGetMemHandle(b)))
                    for b, n in sorted(spans.items())
                ]
        self._export = msgspec.msgpack.encode(Exported(host_identity(), exported))
        with cupy.cuda.Device(self._dev):
            self._kernel = cupy.RawKernel(_KERNEL, "kvpush_piece_copy")
            self._kernel.compile()
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._host: np.ndarray | None = None  # pinned staging of kernel tables
        # "mapped" (default): the kernel reads its table from pinned host memory, one CUDA
        # call fewer per copy; "upload": copy it to the device first.
        self.mapped_table = os.environ.get("KVPUSH_PEER_COPY_TABLE", "mapped") == "mapped"
        self._bound = 0  # the thread the device was made current on
        self.times: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=64))
        self._device_buf: Any = None
        self._last_args: tuple[Any, tuple[Any, ...]] = (None, ())
        self.peers: dict[str, _Mapped | None] = {}  # None: this peer is declined
        self._opened: dict[str, list[int]] = {}
        self.stats: Counter[str] = Counter()

    def export(self) -> bytes:
        return self._export

    def copy(self, peer: str, exported: bytes, plan: CopyPlan) -> bool:
        if peer not in self.peers:
            self.peers[peer] = self._open(peer, exported)
        mapped = self.peers[peer]
        if mapped is None or len(plan.pieces) > MAX_ROWS:
            return False
        if not plan.blocks or not len(plan.pieces):
            return True
        t0 = time.perf_counter()
        route = mapped.route
        if route is None or route.pieces is not plan.pieces:  # once per peer, in practice
            route = mapped.route = _Route(mapped, plan.pieces)
        if not route.fits(plan):
            self.stats["outside_export"] += 1
            log.warning("a block of %s lies outside what it exported; writing instead", peer)
            return False
        n = table_len(plan.pieces, plan.src, plan.dst)
        host = self._host_buffer(n)
        most = route.fill(host, plan)
        if self._bound != threading.get_ident():  # once per thread: fewer CUDA calls per copy
            self._cupy.cuda.runtime.setDevice(self._dev)
            self._bound = threading.get_ident()
        with self.stream:
            table = self._device_table(host, n)
            t1 = time.perf_counter()
            self._kernel(
                (most * route.tiles, len(plan.pieces)),
                (THREADS,),
                self._args(table, len(route.head), route.tiles),
            )
            t2 = time.perf_counter()
            self.stream.synchronize()  # every byte is in D's blocks before the completion
        t3 = time.perf_counter()
        self.stats["copies"] += 1
        for k, dt in (("table", t1 - t0), ("launch", t2 - t1), ("wait", t3 - t2)):
            self.times[k].append(dt * 1e6)
        return True

    def _args(self, table: int, rows: int, tiles: int) -> tuple[Any, ...]:
        """The kernel's arguments; the same tuple while the table stays where it is."""
        key = (table, rows, tiles)
        if self._last_args[0] != key:
            ids = np.uint64(table + 80 * rows)  # the ids follow the rows of 10 int64
            self._last_args = (key, (np.uint64(table), ids, np.int64(TILE), np.int64(tiles)))
        return self._last_args[1]

    def timing_us(self) -> dict[str, float]:
        """Median microseconds of the copy's host stages over the last copies."""
        return {k: float(np.median(v)) for k, v in self.times.items() if v}

    def _host_buffer(self, n: int) -> np.ndarray:
        """The pinned host buffer for kernel tables, grown (with its device twin) as needed."""
        cupy = self._cupy
        if self._host is None or self._host.size < n:
            size = 1 << max(12, int(n - 1).bit_length())
            mem = cupy.cuda.alloc_pinned_memory(size * 8)
            self._host = np.frombuffer(mem, dtype=np.int64, count=size)
            self._device_buf = None if self.mapped_table else cupy.empty(size, dtype=cupy.int64)
        return self._host

    def _device_table(self, host: np.ndarray, n: int) -> int:
        """Where the kernel reads the table: the pinned buffer itself, or a copy on the device."""
        if self.mapped_table:  # pinned memory is mapped for the device (UVA): no copy call
            return int(host.ctypes.data)
        rt = self._cupy.cuda.runtime
        ptr = int(self._device_buf.data.ptr)
        rt.memcpyAsync(ptr, host.ctypes.data, n * 8, rt.memcpyHostToDevice, self.stream.ptr)
        return ptr

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
                    base, size = allocation_range(opened[-1])
                    if base != opened[-1] or size < s.size:
                        raise LayoutError(f"peer claims {s.size} bytes, {size} are mapped")
                    spans.append(s)
        except Exception as e:  # not peer-accessible, same process, handle gone, ...
            self.stats["open_failed"] += 1
            log.warning("cannot map the memory of %s (%s); writing instead", peer, e)
            self._close(opened)
            return None
        self._opened[peer] = opened
        self.stats["mapped"] += 1
        log.info("mapped %d allocations of %s for direct copies", len(opened), peer)
        return _Mapped(spans, opened)

    def forget(self, peer: str) -> None:
        self.peers.pop(peer, None)
        self._close(self._opened.pop(peer, []))

    def _close(self, opened: list[int]) -> None:
        with self._cupy.cuda.Device(self._dev):
            for at in opened:
                with contextlib.suppress(Exception):
                    self._cupy.cuda.runtime.ipcCloseMemHandle(at)

    def close(self) -> None:
        for peer in list(self._opened):
            self.forget(peer)


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
