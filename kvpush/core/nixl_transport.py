"""The one module that imports NIXL: a Transport over a real NIXL agent (UCX by default)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping

import numpy as np

from kvpush.core.errors import PeerGoneError, PeerUnknownError, TransportError
from kvpush.core.layout import KVLayout
from kvpush.core.transport import Rows, Transport, WriteState

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _mapped(what: str) -> Iterator[None]:
    """Turn NIXL's exceptions (matched by class name) into kvpush's."""
    try:
        yield
    except TransportError:
        raise
    except Exception as e:  # NIXL raises its own classes from a compiled module
        name = type(e).__name__
        if "Disconnect" in name:
            raise PeerGoneError(f"{what}: {e}") from e
        if "NotFound" in name:
            raise PeerUnknownError(f"{what}: {e}") from e
        raise TransportError(f"{what}: {name}: {e}") from e


def _nixl_rows(rows: Rows) -> Rows:
    # NIXL takes a list of (address, length, device) tuples as it is, an array if contiguous.
    return rows if isinstance(rows, list) else np.ascontiguousarray(rows)


def ucx_warning(env: Mapping[str, str], mem_type: str) -> str | None:
    """A warning for UCX settings known to break KV pushes from or into GPU memory."""
    value = env.get("UCX_RMA_PPLN_ENABLE", "").strip().lower()
    if mem_type == "VRAM" and value in ("y", "yes", "on", "1", "true"):
        return (
            "UCX_RMA_PPLN_ENABLE=y with KV in GPU memory: in every kvpush GPU run over TCP "
            "with 128-512 MiB pushes, a decoder's connections broke after a few of them and "
            "stayed broken until restart; without it the same runs had no failure "
            "(docs/benchmarks.md, '2k / 8k / 32k under MPS'). Unset it."
        )
    return None


class NixlTransport(Transport):
    """A NIXL agent with its progress thread off: the worker's ticks drive it."""

    def __init__(self, agent_name: str, backends: tuple[str, ...] = ("UCX",)) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if "NIXL_LOG_LEVEL" not in os.environ:  # its INFO lines drown our output
            logging.getLogger("nixl").setLevel(logging.WARNING)

        # The progress thread busy-spins a core; our ticks poll instead.
        config = nixl_agent_config(enable_prog_thread=False, backends=list(backends))
        with _mapped("create agent"):
            self._agent = nixl_agent(agent_name, config)
        self._config = config
        self._probe_lock = threading.Lock()
        self._probes = 0
        self.agent_name = agent_name
        self._mem_type = "DRAM"
        self._registered: list[object] = []
        self._peers: set[str] = set()

    def register(self, layout: KVLayout) -> None:
        self._mem_type = layout.mem_type
        warning = ucx_warning(os.environ, layout.mem_type)
        if warning:
            log.warning(warning)
        # Several regions may share one allocation: register each range once.
        spans = sorted({(r.base_addr, r.nbytes, r.device_id) for r in layout.regions})
        descs = [(addr, n, dev, "") for addr, n, dev in spans]
        with _mapped("register memory"):
            self._registered.append(self._agent.register_memory(descs, layout.mem_type))

    def metadata(self) -> bytes:
        with _mapped("get metadata"):
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, name: str, metadata: bytes) -> None:
        if name in self._peers:
            self.remove_peer(name)
        with _mapped(f"add peer {name}"):
            loaded = self._agent.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise TransportError(f"peer metadata names {loaded!r}, expected {name!r}")
        self._peers.add(name)

    def probe(self, metadata: bytes) -> None:
        # A throwaway agent of its own, so that no lock of ours or NIXL's is held while
        # UCX connects (add_remote_agent waits for the TCP connection: the kernel's SYN
        # retries, over 2 min, where the path drops packets). About 40 ms on CPU, once
        # per new peer.
        from nixl._api import nixl_agent

        with self._probe_lock, _mapped("create a probe agent"):  # one creation at a time
            self._probes += 1
            agent = nixl_agent(f"{self.agent_name}-probe-{self._probes}", self._config)
        try:
            with _mapped("probe"):
                agent.remove_remote_agent(agent.add_remote_agent(metadata))
        finally:
            del agent

    def remove_peer(self, name: str) -> None:
        if name not in self._peers:
            return
        self._peers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # best effort: the peer may already be gone
            log.debug("remove_remote_agent(%s): %s", name, e)

    def write(self, peer: str, src: Rows, dst: Rows, notif: bytes) -> object:
        if peer not in self._peers:
            raise PeerUnknownError(f"peer {peer} not added")
        with _mapped(f"write to {peer}"):
            local = self._agent.get_xfer_descs(_nixl_rows(src), self._mem_type)
            remote = self._agent.get_xfer_descs(_nixl_rows(dst), self._mem_type)
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
            try:
                state = self._agent.transfer(handle)
            except Exception:
                self._agent.release_xfer_handle(handle)
                raise
        if state == "ERR":
            self._agent.release_xfer_handle(handle)
            raise TransportError(f"write to {peer} failed at post")
        return handle

    def check(self, handle: object) -> WriteState:
        with _mapped("check write"):
            state = self._agent.check_xfer_state(handle)
        if state == "DONE":
            return WriteState.DONE
        if state == "PROC":
            return WriteState.PENDING
        return WriteState.ERROR

    def release(self, handle: object) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            log.warning("release of a write handle failed: %s", e)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if peer not in self._peers:
            raise PeerUnknownError(f"peer {peer} not added")
        with _mapped(f"notify {peer}"):
            self._agent.send_notif(peer, msg)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        with _mapped("get notifications"):
            got = self._agent.get_new_notifs()
        return [(str(peer), bytes(m)) for peer, msgs in got.items() for m in msgs]

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        for reg in self._registered:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.debug("deregister: %s", e)
        self._registered.clear()
