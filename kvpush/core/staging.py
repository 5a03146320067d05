"""The optional staging hook: many small scattered blocks as ONE WRITE.

A WRITE costs per descriptor, so a request whose blocks are scattered moves at
a few percent of the link. With a hook set on ``PushWorker.staging``:

* D reserves a slot of its staging buffer for a registration (``offer``) and
  names it in ``PushReg.staging``;
* P gathers its blocks into its own staging buffer with one kernel and WRITEs
  them with one descriptor into D's slot (``plan``), with a ``PUSH_STAGED``
  notification instead of the plain completion;
* on that notification D scatters the slot into its blocks (``unstage``) before
  it reports the request in ``finished_recving``.

P chooses per transfer: ``plan`` returns None to WRITE directly (long runs, no
room, a D without staging), and P then sends the plain completion, on which D
only frees the slot. A peer without a hook ignores the optional field. The
implementation lives in ``kvpush.gpu.staging``; the core never imports torch.
Every method is called on the writer thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvpush.core.layout import KVLayout, Region
from kvpush.core.wire import StagingSlot


class StagingHook(Protocol):
    """Gather / one WRITE / scatter for transfers of many small runs."""

    region: Region  # our staging buffer: registered with the transport, advertised at handshake

    def offer(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> StagingSlot | None:
        """D: reserve a slot for all bytes of these local blocks, or None (no room)."""
        ...

    def unstage(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """D: copy the slot of ``request_id`` into its blocks and wait; raises on failure."""
        ...

    def release_recv(self, request_id: str) -> None:
        """D: free the slot of ``request_id`` (unknown ids are ignored)."""
        ...

    def plan(
        self,
        request_id: str,
        remote: KVLayout,
        remote_staging: Region | None,
        slot: StagingSlot,
        src_groups: Sequence[Sequence[int]],
        dst_groups: Sequence[Sequence[int] | np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """P: gather into our staging and return the one-row (src, dst) WRITE, or None: direct.

        Raises LayoutError when the block ids do not fit the layouts (as the direct path).
        """
        ...

    def release_push(self, request_id: str) -> None:
        """P: the transfer ended (its WRITE is done or failed): free our slot."""
        ...
