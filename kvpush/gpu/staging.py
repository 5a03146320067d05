"""GpuStaging: the core's StagingHook over torch tensors (see kvpush/core/staging.py).

P gathers the byte runs of a transfer (the source side of ``routing.build_pair_descs``,
in its order) into a slot of its staging buffer with one batched copy, then the
core WRITEs the slot with one descriptor into the slot D reserved. D scatters
its slot into its blocks (its own extents, region by region, in block order:
the destination side of the same descriptors) and waits for the copy before
the core reports the request received.

Chosen per transfer (``plan``): staged when the average run is shorter than
``min_direct_run`` bytes, the whole transfer fits the slot D offered, and P has
room; otherwise None and the core WRITEs the runs directly. The buffers are
bounded: a transfer larger than the free staging space goes direct.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, Region, check_compatible, expand, extents
from kvpush.core.wire import StagingSlot
from kvpush.gpu.copy import Copier, make_copier
from kvpush.gpu.slots import SlotAllocator
from kvpush.gpu.tensors import mem_type_of, tensor_nbytes

log = logging.getLogger(__name__)

STAGING_REGION = "kvpush.staging"


def stream_extents(
    layout: KVLayout, groups: Sequence[Sequence[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """(address, length) of the given logical blocks, region by region, in block order.

    Raises LayoutError for ids outside the layout (a cheap check: duplicates are
    harmless to a gather, and D's own ids were validated at registration).
    """
    if len(groups) != layout.groups:
        raise LayoutError(f"{len(groups)} block-id groups for a layout of {layout.groups}")
    arrays = [np.asarray(g, dtype=np.int64) for g in groups]
    for g, ids in enumerate(arrays):
        if ids.size and (ids.min() < 0 or ids.max() >= layout.num_logical_blocks(g)):
            raise LayoutError(f"group {g}: block id outside the layout")
    addrs, lens = [], []
    for r in layout.regions:
        ids = arrays[r.group]
        if ids.size:
            a, n = extents(r, expand(ids, layout.physical_per_logical))
            addrs.append(a)
            lens.append(n)
    if not addrs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    return np.concatenate(addrs), np.concatenate(lens)


class GpuStaging:
    """A staging buffer on the KV caches' device, shared by this worker's P and D roles."""

    def __init__(
        self,
        layout: KVLayout,
        tensors: Sequence[Any],
        capacity: int,
        *,
        min_direct_run: int = 4 << 20,
        backend: str = "auto",
        align: int = 4096,
        buffer: Any = None,
    ) -> None:
        import torch

        if not tensors:
            raise LayoutError("GpuStaging needs the KV tensors")
        device = tensors[0].device
        if buffer is None:
            buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        if tensor_nbytes(buffer) < capacity or buffer.device != device:
            raise LayoutError("staging buffer smaller than its capacity or on another device")
        mem, dev = mem_type_of(buffer)
        if mem != layout.mem_type:
            raise LayoutError(f"staging buffer in {mem}, KV caches in {layout.mem_type}")
        self.layout = layout
        self.buffer = buffer
        self.device = device
        self.region = Region(STAGING_REGION, int(buffer.data_ptr()), capacity, 1, dev)
        self.min_direct_run = min_direct_run
        self.slots = SlotAllocator(capacity, align)
        self.copier: Copier = make_copier([*tensors, buffer], backend)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stats: Counter[str] = Counter()
        self._scatter: dict[str, Any] = {}  # D request id -> prepared scatter batch

    def registration_layout(self) -> KVLayout:
        """The staging buffer as a one-region layout, for ``Transport.register``."""
        return KVLayout(regions=[self.region], block_size=1, mem_type=self.layout.mem_type)

    @contextlib.contextmanager
    def _on_stream(self, wait: bool = True) -> Iterator[None]:
        """Run the enclosed work on our stream, then (``wait``) wait for it."""
        if self.stream is None:
            yield
            return
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield
        if wait:
            self.stream.synchronize()

    # ---- D ---------------------------------------------------------------------------------

    def offer(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> StagingSlot | None:
        addr, lens = stream_extents(self.layout, block_ids)
        nbytes = int(lens.sum())
        if nbytes == 0:
            return None
        key = ("recv", request_id)
        off = self.slots.alloc(key, nbytes)
        if off is None:
            self.stats["offer_no_room"] += 1
            return None
        # The scatter is planned (and its table uploaded) now, off the path of the WRITE.
        src = self.region.base_addr + off + np.cumsum(lens) - lens
        try:
            with self._on_stream(wait=False):
                self._scatter[request_id] = (self.copier.prepare(src, addr, lens), nbytes)
        except Exception:
            self.slots.free(key)
            raise
        self.stats["offered"] += 1
        return StagingSlot(off, nbytes)

    def unstage(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        del block_ids  # the scatter was planned from the same ids at ``offer``
        got = self._scatter.get(request_id)
        if got is None:
            raise LayoutError(f"no staging slot for {request_id}")
        with self._on_stream():
            self.copier.launch(got[0])
        self.stats["unstaged"] += 1
        self.stats["unstaged_bytes"] += got[1]

    def release_recv(self, request_id: str) -> None:
        self._scatter.pop(request_id, None)
        self.slots.free(("recv", request_id))

    # ---- P ---------------------------------------------------------------------------------

    def plan(
        self,
        request_id: str,
        remote: KVLayout,
        remote_staging: Region | None,
        slot: StagingSlot,
        src_groups: Sequence[Sequence[int]],
        dst_groups: Sequence[Sequence[int] | np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray] | None:
        if remote_staging is None:
            return None
        # P's own runs, in the byte order of the direct WRITE's destination side.
        addr, lens = stream_extents(self.layout, src_groups)
        if [len(g) for g in src_groups] != [len(g) for g in dst_groups]:
            raise LayoutError("source and destination hold different numbers of blocks")
        check_compatible(self.layout, remote)
        total = int(lens.sum())
        if total == 0:
            return None
        if slot.offset + slot.nbytes > remote_staging.nbytes or total != slot.nbytes:
            self.stats["slot_mismatch"] += 1
            log.warning("staging slot %s of %s does not fit the transfer", slot, request_id)
            return None
        if total / len(lens) >= self.min_direct_run:
            self.stats["direct_long_runs"] += 1
            return None
        key = ("push", request_id)
        off = self.slots.alloc(key, total)
        if off is None:
            self.stats["push_no_room"] += 1
            return None
        dst_local = self.region.base_addr + off + np.cumsum(lens) - lens
        try:
            with self._on_stream():
                self.copier.copy(addr, dst_local, lens)
        except Exception as e:  # a failed gather falls back to the direct WRITE
            self.slots.free(key)
            self.stats["gather_failed"] += 1
            log.warning("gather of %s failed, writing directly: %s", request_id, e)
            return None
        self.stats["staged"] += 1
        self.stats["staged_bytes"] += total
        one_src = np.array([[self.region.base_addr + off, total, self.region.device_id]], np.int64)
        one_dst = np.array(
            [[remote_staging.base_addr + slot.offset, total, remote_staging.device_id]], np.int64
        )
        return one_src, one_dst

    def release_push(self, request_id: str) -> None:
        self.slots.free(("push", request_id))
