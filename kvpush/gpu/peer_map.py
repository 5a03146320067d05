"""Opening a same-host peer's exported memory and its completion lane, for CudaPeerCopy.

A mixin of CudaPeerCopy (peer_copy.py): these methods use the hook's CUDA handles and
tables, which its ``__init__`` sets.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.lane import LaneView, host_identity
from kvpush.core.peer_copy import Signal
from kvpush.gpu.driver import Driver
from kvpush.gpu.peer_table import TILE, WAKE_BYTES, Exported, Span, _Mapped, _Prepared

log = logging.getLogger("kvpush.gpu.peer_copy")  # the hook's one logger, as before the split


class PeerMaps:
    """Maps peers' memory into this process (CudaPeerCopy's ``_open`` and its helpers)."""

    _cupy: Any
    _dev: int
    _drv: Driver
    _pci: str
    _scratch: int
    _opened: dict[str, list[int]]
    stats: Counter[str]

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
