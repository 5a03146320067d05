"""The optional peer-copy hook: P copies straight into D's memory, NIXL only notifies.

On one host, GPU memory can be mapped into another process (CUDA IPC). Then one
kernel on P can read P's scattered blocks and write D's scattered blocks in a
single pass, where a NIXL WRITE pays per descriptor and the staging hook pays
three passes. With a hook set on ``PushWorker.peer_copy``:

* every worker advertises ``export()`` in its handshake (``AgentInfo.peer_copy``):
  what a process on the same host needs to map its KV memory;
* P, for each transfer, hands ``copy`` a ``CopyPlan``: the block ids (validated)
  and the peer's ``block_pieces`` rows (which bytes of a block go where, once per
  peer), so a kernel expands them on the device instead of the host building a
  descriptor per block. True means every byte is in D's blocks (the copy was
  waited for), and P sends the plain completion instead of posting a WRITE.
  False (another host, no mapping, a range outside what D exported) falls back
  to the WRITE, for that transfer and every later one to the same peer (until
  the peer is forgotten: a restarted decoder is asked again).

D needs nothing new: the completion is the same as after a WRITE. The
implementation lives in ``kvpush.gpu.peer_copy``; the core never imports torch.
``copy`` and ``forget`` are called on the writer thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, as_ids, validate_block_ids


@dataclass(frozen=True)
class CopyPlan:
    """One transfer for a peer-copy hook (see ``routing.block_pieces`` for ``pieces``)."""

    pieces: np.ndarray  # Kx9 rows, PIECE_COLUMNS
    src: list[np.ndarray]  # our logical block ids, per group
    dst: list[np.ndarray]  # the peer's, per group; pieces pair src[g] with dst[g']
    blocks: int  # logical blocks moved
    nbytes: int
    dst_max: list[int]  # the largest of dst[g] (-1 when empty): what the hook bounds-checks


def copy_plan(
    p: KVLayout | list[int],
    d: KVLayout | list[int],
    pieces: np.ndarray,
    src_groups: Sequence[Sequence[int] | np.ndarray],
    dst_groups: Sequence[np.ndarray],
) -> CopyPlan:
    """The ids as arrays, range-checked against both layouts, group sizes matched.

    ``p`` and ``d`` may be given as their ``group_limits`` (computed once per peer).
    Ranges only: D's ids were deduplicated on arrival, and a repeated id of our own
    could only copy one of our blocks twice, never outside D's registered blocks.
    """
    src = [as_ids(g) for g in src_groups]
    dst = [as_ids(g) for g in dst_groups]
    validate_block_ids(p, src, unique_known=True)
    dst_max = validate_block_ids(d, dst, unique_known=True)
    nbytes = 0
    for row in pieces.tolist():
        n, sg, dg = row[6], row[7], row[8]
        if len(src[sg]) != len(dst[dg]):
            have, want = len(src[sg]), len(dst[dg])
            raise LayoutError(f"group {sg}: {have} source blocks, {want} destination")
        nbytes += n * len(src[sg])
    return CopyPlan(pieces, src, dst, sum(len(g) for g in src), nbytes, dst_max)


class PeerCopyHook(Protocol):
    def export(self) -> bytes:
        """What a peer on this host needs to map our KV memory (opaque to the core)."""
        ...

    def copy(self, peer: str, exported: bytes, plan: CopyPlan) -> bool:
        """Move ``plan`` into the peer's memory and wait for it.

        ``exported`` is the peer's ``export()``. Returns False, having copied nothing,
        when this peer cannot be reached this way; raises if a started copy failed.
        """
        ...

    def forget(self, peer: str) -> None:
        """Drop any mapping of the peer's memory (it left or restarted)."""
        ...
