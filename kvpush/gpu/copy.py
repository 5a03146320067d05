"""Batched copies between raw address ranges of known tensors, enqueued on the current stream.

A batch is three int64 arrays (source address, destination address, length).
Two backends:

* ``cupy``: ONE kernel for the whole batch (16-byte vector loads, byte loop for
  unaligned rows), rows cut into tiles so the grid fills the GPU. CUDA only.
* ``torch``: no extra package; one ``index_select`` / ``index_copy_`` per pair of
  (source storage, destination storage), over the largest common granule of the
  rows. Works on CPU tensors too (the CPU tests run the staging path with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpush.core.errors import LayoutError

# Shared by every copy kernel of the package (peer_copy.py's too).
COPY_RANGE = r"""
// n bytes from s to d by the threads of one block: 16-byte vectors with eight loads in
// flight per thread before any store when s, d and n are 16-byte aligned, else bytes.
__device__ __forceinline__ void kvpush_copy_range(unsigned long long s, unsigned long long d,
                                                  long long n) {
    if (((s | d | (unsigned long long)n) & 15ULL) == 0ULL) {
        const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(s);
        uint4* __restrict__ d4 = reinterpret_cast<uint4*>(d);
        long long n4 = n >> 4, j = threadIdx.x, st = blockDim.x;
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

_KERNEL = (
    COPY_RANGE
    + r"""
extern "C" __global__ void kvpush_batched_copy(const unsigned long long* __restrict__ table,
                                                long long n) {
    long long i = blockIdx.x;
    if (i < n) kvpush_copy_range(table[i], table[n + i], (long long)table[2 * n + i]);
}
"""
)
THREADS = 256
MAX_TILE = 1 << 20
MIN_TILE = 4 << 10


def split_rows(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, tile: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every row into pieces of at most ``tile`` bytes (tile a multiple of 16)."""
    if int(length.max()) <= tile:
        return src, dst, length
    pieces = -(-length // tile)
    total = int(pieces.sum())
    first = np.cumsum(pieces) - pieces
    off = (np.arange(total, dtype=np.int64) - np.repeat(first, pieces)) * tile
    return (
        np.repeat(src, pieces) + off,
        np.repeat(dst, pieces) + off,
        np.minimum(np.repeat(length, pieces) - off, tile),
    )


def tile_for(total: int) -> int:
    """Aim at about a thousand tiles (enough blocks to fill the GPU), within bounds."""
    return max(MIN_TILE, min(MAX_TILE, (total // 1024) & ~15))


def _flat_storage(t: Any) -> Any:
    """A flat uint8 tensor over the whole storage behind ``t``."""
    import torch

    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat


class Copier:
    """Base: knows the spans (flat byte tensors) that every address must fall into."""

    name = "base"

    def __init__(self, tensors: Sequence[Any]) -> None:
        seen: dict[int, Any] = {}
        for t in tensors:
            flat = _flat_storage(t)
            seen.setdefault(int(flat.data_ptr()), flat)
        self.spans = [seen[k] for k in sorted(seen)]
        self.bases = np.array([int(s.data_ptr()) for s in self.spans], dtype=np.int64)
        self.sizes = np.array([int(s.numel()) for s in self.spans], dtype=np.int64)
        self.device = self.spans[0].device

    def check(self, addr: np.ndarray, length: np.ndarray) -> None:
        """LayoutError unless every range lies inside one of the spans (fast when one holds all)."""
        lo, hi = int(addr.min()), int((addr + length).max())
        i = int(np.searchsorted(self.bases, lo, side="right")) - 1
        if i >= 0 and hi <= int(self.bases[i] + self.sizes[i]):
            return
        self.locate(addr, length)

    def locate(self, addr: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(span index, offset in span) of each range; LayoutError if one is outside all spans."""
        idx = np.searchsorted(self.bases, addr, side="right") - 1
        bad = idx < 0
        idx = np.maximum(idx, 0)
        off = addr - self.bases[idx]
        bad |= off + length > self.sizes[idx]
        if bad.any():
            raise LayoutError(f"{int(bad.sum())} copy ranges outside the registered tensors")
        return idx, off

    def prepare(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Any:
        """Host work and uploads for a batch, on the current stream; ``launch`` runs it."""
        raise NotImplementedError

    def launch(self, prepared: Any) -> None:
        """Enqueue a prepared batch on the current stream (it may be launched again)."""
        raise NotImplementedError

    def copy(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
        self.launch(self.prepare(src, dst, length))


class TorchCopier(Copier):
    """index_select / index_copy_ over granules; one or two kernels per storage pair."""

    name = "torch"

    def prepare(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Any:
        if len(length) == 0:
            return []
        si, so = self.locate(src, length)
        di, do = self.locate(dst, length)
        pair = si * len(self.spans) + di
        steps = []
        for key in np.unique(pair):
            sel = pair == key
            s_flat = self.spans[int(key) // len(self.spans)]
            d_flat = self.spans[int(key) % len(self.spans)]
            steps.append(self._prepare_pair(s_flat, d_flat, so[sel], do[sel], length[sel]))
        return steps

    def _prepare_pair(
        self, s_flat: Any, d_flat: Any, so: np.ndarray, do: np.ndarray, ln: np.ndarray
    ) -> tuple[Any, ...]:
        g = int(np.gcd.reduce(np.concatenate([ln, so, do])))
        s_view, d_view = _granules(s_flat, g), _granules(d_flat, g)
        counts = ln // g
        s_idx, d_idx = _expand(so // g, counts), _expand(do // g, counts)
        dev = self.device
        if _is_range(d_idx):  # gather into one contiguous range
            a = int(d_idx[0])
            return ("select", s_view, _to(s_idx, dev), d_view[a : a + len(d_idx)])
        if _is_range(s_idx):  # scatter out of one contiguous range
            a = int(s_idx[0])
            return ("copy", d_view, _to(d_idx, dev), s_view[a : a + len(s_idx)])
        return ("both", d_view, _to(d_idx, dev), s_view, _to(s_idx, dev))

    def launch(self, prepared: Any) -> None:
        import torch

        for step in prepared:
            if step[0] == "select":
                torch.index_select(step[1], 0, step[2], out=step[3])
            elif step[0] == "copy":
                step[1].index_copy_(0, step[2], step[3])
            else:
                step[1].index_copy_(0, step[2], step[3].index_select(0, step[4]))


def _granules(flat: Any, g: int) -> Any:
    """``flat`` as rows of ``g`` bytes, in 8-byte words when alignment allows."""
    import torch

    rows = flat[: (flat.numel() // g) * g].view(-1, g)
    if g % 8 == 0 and flat.data_ptr() % 8 == 0:
        rows = rows.view(torch.int64)
    return rows


def _expand(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges [starts[i], starts[i] + counts[i])."""
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _is_range(idx: np.ndarray) -> bool:
    return (
        bool(idx.size)
        and int(idx[-1]) - int(idx[0]) == idx.size - 1
        and bool(np.all(np.diff(idx) == 1))
    )


def _to(a: np.ndarray, device: Any) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)


class CupyCopier(Copier):
    """One CUDA kernel per batch, compiled once per process and device with NVRTC."""

    name = "cupy"
    _kernels: dict[int, Any] = {}

    def __init__(self, tensors: Sequence[Any]) -> None:
        super().__init__(tensors)
        import cupy

        if self.device.type != "cuda":
            raise LayoutError("the cupy copier needs CUDA tensors")
        self._cupy = cupy
        self._dev = int(self.device.index or 0)
        with cupy.cuda.Device(self._dev):
            k = self._kernels.get(self._dev)
            if k is None:
                k = cupy.RawKernel(_KERNEL, "kvpush_batched_copy")
                k.compile()
                self._kernels[self._dev] = k
        self._kernel = k

    def prepare(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Any:
        if len(length) == 0:
            return None
        self.check(src, length)
        self.check(dst, length)
        s, d, n = split_rows(src, dst, length, tile_for(int(length.sum())))
        # Allocated on the current stream: reused only after work queued on it.
        return _to(np.concatenate([s, d, n]), self.device), len(n)

    def launch(self, prepared: Any) -> None:
        import torch

        if prepared is None:
            return
        table, n = prepared
        stream = torch.cuda.current_stream(self.device)
        with self._cupy.cuda.Device(self._dev), self._cupy.cuda.ExternalStream(stream.cuda_stream):
            self._kernel((n,), (THREADS,), (np.uint64(table.data_ptr()), np.int64(n)))


def make_copier(tensors: Sequence[Any], backend: str = "auto") -> Copier:
    """``auto``: the CuPy kernel on CUDA when CuPy is importable, else torch."""
    if backend not in ("auto", "cupy", "torch"):
        raise ValueError(f"unknown copy backend {backend!r}")
    cuda = tensors[0].device.type == "cuda"
    if backend == "cupy" or (backend == "auto" and cuda):
        try:
            return CupyCopier(tensors)
        except ImportError:
            if backend == "cupy":
                raise
    return TorchCopier(tensors)
