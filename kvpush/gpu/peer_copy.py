"""CudaPeerCopy: the core's PeerCopyHook over CUDA IPC (see kvpush/core/peer_copy.py).

Each worker exports CUDA IPC handles of the allocations behind its KV tensors,
with their base addresses and a host identity. P, on its first transfer to a
peer on the same host, opens the peer's handles (mapping D's KV memory into its
own address space, peer access enabled lazily for another GPU) and from then on
moves a transfer with ONE kernel (``copy.CupyCopier``: every P range straight
into its D range, one pass over the bytes) on its own stream, waits for it, and
lets the core send the completion. A peer on another host, a mapping that fails
or a range outside what the peer exported is declined: the core WRITEs instead.

Trust: a peer that completed the handshake may write into these allocations,
as NIXL's metadata already lets it (use ``shared_secret`` on shared hosts).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import socket
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.gpu.copy import CupyCopier

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


class _Mapped:
    """A peer's exported spans, opened here: remote base -> local address."""

    def __init__(self, spans: Sequence[Span], local: Sequence[int]) -> None:
        order = np.argsort([s.base for s in spans])
        self.remote = np.array([spans[i].base for i in order], dtype=np.int64)
        self.sizes = np.array([spans[i].size for i in order], dtype=np.int64)
        self.local = np.array([local[i] for i in order], dtype=np.int64)

    def translate(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray | None:
        """Local addresses of the peer's ranges, or None if one lies outside every span."""
        if len(self.remote) == 1:  # the usual case: one allocation holds the whole cache
            lo, hi = int(addr.min()), int((addr + length).max())
            if lo < self.remote[0] or hi > self.remote[0] + self.sizes[0]:
                return None
            shifted: np.ndarray = addr + (self.local[0] - self.remote[0])
            return shifted
        idx = np.searchsorted(self.remote, addr, side="right") - 1
        if (idx < 0).any():
            return None
        off = addr - self.remote[idx]
        if (off + length > self.sizes[idx]).any():
            return None
        out: np.ndarray = self.local[idx] + off
        return out


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
        self.copier = CupyCopier(tensors)
        self.stream = torch.cuda.Stream(self.device)
        self.peers: dict[str, _Mapped | None] = {}  # None: this peer is declined
        self._opened: dict[str, list[int]] = {}
        self.stats: Counter[str] = Counter()

    def export(self) -> bytes:
        return self._export

    def copy(self, peer: str, exported: bytes, src: np.ndarray, dst: np.ndarray) -> bool:
        if peer not in self.peers:
            self.peers[peer] = self._open(peer, exported)
        mapped = self.peers[peer]
        if mapped is None or not len(src):
            return mapped is not None
        local = mapped.translate(dst[:, 0], dst[:, 1])
        if local is None:
            self.stats["outside_export"] += 1
            log.warning("a range for %s lies outside what it exported; writing instead", peer)
            return False
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.copier.copy(src[:, 0], local, src[:, 1])
        self.stream.synchronize()  # every byte is in D's blocks before the completion
        self.stats["copies"] += 1
        return True

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
                for s in info.spans:
                    opened.append(int(rt.ipcOpenMemHandle(s.handle, lazy)))
        except Exception as e:  # not peer-accessible, same process, handle gone, ...
            self.stats["open_failed"] += 1
            log.warning("cannot map the memory of %s (%s); writing instead", peer, e)
            self._close(opened)
            return None
        for s, at in zip(info.spans, opened, strict=True):
            self.copier.add_span(at, s.size)
        self._opened[peer] = opened
        self.stats["mapped"] += 1
        log.info("mapped %d allocations of %s for direct copies", len(opened), peer)
        return _Mapped(info.spans, opened)

    def forget(self, peer: str) -> None:
        self.peers.pop(peer, None)
        opened = self._opened.pop(peer, [])
        for at in opened:
            self.copier.remove_span(at)
        self._close(opened)

    def _close(self, opened: list[int]) -> None:
        with self._cupy.cuda.Device(self._dev):
            for at in opened:
                with contextlib.suppress(Exception):
                    self._cupy.cuda.runtime.ipcCloseMemHandle(at)

    def close(self) -> None:
        for peer in list(self._opened):
            self.forget(peer)
