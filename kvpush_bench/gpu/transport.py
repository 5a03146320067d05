"""NixlTransport for CUDA memory: every calling thread bound to the KV caches' device.

NIXL's UCX backend reaches CUDA memory through the calling thread's current
CUDA context. The worker's writer thread is created by the core and never
touches CUDA itself, so without a current context each WRITE, check and poll
takes a slower path. This transport makes the device (its primary context)
current once in each thread that calls it.
"""

from __future__ import annotations

import threading

import numpy as np

from kvpush.core.nixl_transport import NixlTransport
from kvpush.core.transport import WriteState


class CudaNixlTransport(NixlTransport):
    def __init__(self, agent_name: str, device_index: int, backends: tuple[str, ...] = ("UCX",)):
        self._device_index = device_index
        self._bound = threading.local()
        self._bind()
        super().__init__(agent_name, backends)

    def _bind(self) -> None:
        if not getattr(self._bound, "done", False):
            import torch

            torch.cuda.set_device(self._device_index)
            self._bound.done = True

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._bind()
        super().add_peer(name, metadata)

    def write(self, peer: str, src: np.ndarray, dst: np.ndarray, notif: bytes) -> object:
        self._bind()
        return super().write(peer, src, dst, notif)

    def prep(self, peer: str | None, descs: np.ndarray) -> object:
        self._bind()
        return super().prep(peer, descs)

    def write_prepped(
        self,
        peer: str,
        local: object,
        local_idx: np.ndarray,
        remote: object,
        remote_idx: np.ndarray,
        notif: bytes,
    ) -> object:
        self._bind()
        return super().write_prepped(peer, local, local_idx, remote, remote_idx, notif)

    def check(self, handle: object) -> WriteState:
        self._bind()
        return super().check(handle)

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._bind()
        super().send_notif(peer, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._bind()
        return super().get_notifs()
