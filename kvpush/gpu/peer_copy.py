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

The kernel, its table and the per-peer records are in peer_table.py, opening a peer's
memory in peer_map.py; this module re-exports their names.

Trust: a peer that completed the handshake may write into these allocations,
as NIXL's metadata already lets it (use ``shared_secret`` on shared hosts).
"""

from __future__ import annotations

import array
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
from kvpush.core.lane import host_identity
from kvpush.core.peer_copy import CopyDst
from kvpush.gpu.driver import Driver, function_of, handle
from kvpush.gpu.peer_map import PeerMaps
from kvpush.gpu.peer_table import (
    _KERNEL,
    FUSED_MAX_BLOCKS,
    MAX_GRID_X,
    MAX_ROWS,
    THREADS,
    TILE,
    WAKE_AFTER_S,
    WAKE_BYTES,
    Exported,
    Span,
    _Mapped,
    _Prepared,
    _Route,
    fill_table,
    table_len,
)

__all__ = [
    "FUSED_MAX_BLOCKS",
    "MAX_GRID_X",
    "MAX_ROWS",
    "THREADS",
    "TILE",
    "WAKE_AFTER_S",
    "WAKE_BYTES",
    "_KERNEL",
    "CudaPeerCopy",
    "Exported",
    "Span",
    "_Mapped",
    "_Prepared",
    "_Route",
    "fill_table",
    "make_peer_copy",
    "table_len",
]

log = logging.getLogger(__name__)


def _handle_of(kernel: Any) -> Any:
    func = function_of(kernel)
    return None if func is None else handle(func)


class CudaPeerCopy(PeerMaps):
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
