"""The optional peer-copy hook: P copies straight into D's memory, NIXL only notifies.

On one host, GPU memory can be mapped into another process (CUDA IPC). Then one
kernel on P can read P's scattered blocks and write D's scattered blocks in a
single pass, where a NIXL WRITE pays per descriptor and the staging hook pays
three passes. With a hook set on ``PushWorker.peer_copy``:

* every worker advertises ``export()`` in its handshake (``AgentInfo.peer_copy``):
  what a process on the same host needs to map its KV memory;
* P, for each transfer, builds the same descriptors as for a WRITE and calls
  ``copy``; True means every byte is in D's blocks (the copy was waited for), and
  P sends the plain completion notification instead of posting a WRITE. False
  (another host, no mapping, a range outside what D exported) falls back to the
  WRITE, chosen per transfer.

D needs nothing new: the completion is the same as after a WRITE. The
implementation lives in ``kvpush.gpu.peer_copy``; the core never imports torch.
``copy`` and ``forget`` are called on the writer thread only.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class PeerCopyHook(Protocol):
    def export(self) -> bytes:
        """What a peer on this host needs to map our KV memory (opaque to the core)."""
        ...

    def copy(self, peer: str, exported: bytes, src: np.ndarray, dst: np.ndarray) -> bool:
        """Copy Nx3 (address, length, device) rows ``src`` into the peer's ``dst`` rows.

        ``exported`` is the peer's ``export()``. Returns False, having copied nothing,
        when this peer cannot be reached this way; raises if a started copy failed.
        """
        ...

    def forget(self, peer: str) -> None:
        """Drop any mapping of the peer's memory (it left or restarted)."""
        ...
