"""Raw NIXL WRITEs between two processes: the baseline kvpush is compared with.

One agent per side (UCX, progress thread off, as kvpush's own transport), one
registered buffer each. P WRITEs N blocks of X bytes from ``src_ids`` into the
peer's ``dst_ids`` (one descriptor per block) with a notification, and polls
until DONE; D polls notifications. No kvpush code sits in the data path.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np

from kvpush.gpu.tensors import mem_type_of, tensor_nbytes


class RawEndpoint:
    def __init__(self, role: str, buf: Any) -> None:
        import logging

        from nixl._api import nixl_agent, nixl_agent_config

        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name = f"raw{role}-{uuid.uuid4().hex[:8]}"
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = nixl_agent(self.name, config)
        self.mem, self.dev = mem_type_of(buf)
        self.base = int(buf.data_ptr())
        self.nbytes = tensor_nbytes(buf)
        self.reg = self.agent.register_memory([(self.base, self.nbytes, self.dev, "")], self.mem)
        self.peers: list[str] = []

    def info(self) -> dict[str, Any]:
        md = bytes(self.agent.get_agent_metadata())
        return {"metadata": md, "base": self.base, "dev": self.dev, "name": self.name}

    def connect(self, metadata: bytes) -> str:
        got = self.agent.add_remote_agent(metadata)
        name = got.decode() if isinstance(got, bytes) else str(got)
        self.peers.append(name)
        return name

    def rows(self, base: int, dev: int, ids: np.ndarray, block: int) -> np.ndarray:
        addr = base + np.asarray(ids, dtype=np.int64) * block
        return np.stack([addr, np.full_like(addr, block), np.full_like(addr, dev)], axis=1)

    def write(
        self,
        peer: str,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        block: int,
        peer_base: int,
        peer_dev: int,
        notif: bytes,
        timeout_s: float = 60.0,
    ) -> dict[str, float]:
        """One WRITE, timed: descriptors + post (``post_s``) and until DONE (``total_s``)."""
        t0 = time.monotonic()
        src = self.agent.get_xfer_descs(self.rows(self.base, self.dev, src_ids, block), self.mem)
        dst = self.agent.get_xfer_descs(self.rows(peer_base, peer_dev, dst_ids, block), self.mem)
        handle = self.agent.initialize_xfer("WRITE", src, dst, peer, notif)
        state = self.agent.transfer(handle)
        t_post = time.monotonic()
        while state not in ("DONE", "ERR"):
            state = self.agent.check_xfer_state(handle)
            if time.monotonic() - t0 > timeout_s:
                state = "ERR"
        t_done = time.monotonic()
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw WRITE ended {state}")
        return {"t0": t0, "post_s": t_post - t0, "total_s": t_done - t0}

    def wait_notifs(self, n: int, timeout_s: float) -> list[tuple[bytes, float]]:
        """Poll until ``n`` notifications arrived; each with its arrival time."""
        got: list[tuple[bytes, float]] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < n and time.monotonic() < deadline:
            new = self.agent.get_new_notifs()
            now = time.monotonic()
            for msgs in new.values():
                got += [(bytes(m), now) for m in msgs]
        return got

    def close(self) -> None:
        for p in self.peers:
            try:
                self.agent.remove_remote_agent(p)
            except Exception:
                pass
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:
            pass
