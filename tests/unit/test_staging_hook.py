"""The staging hook's path through the core (no torch): gather, one WRITE, scatter.

A numpy hook (ctypes.memmove) stands in for kvpush.gpu.staging.GpuStaging, over
the in-memory transport; D checks every byte as in the other state-machine tests.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import pytest

from kvpush.core import wire
from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, Region
from kvpush.core.memory_transport import Fabric, MemoryTransport
from kvpush.core.worker import make_agent_name
from kvpush.gpu.slots import SlotAllocator
from kvpush.gpu.staging import stream_extents
from kvpush_bench.sim.engine import SimEngine, SimSpec
from tests.conftest import free_port, wait_until

FAST = {"heartbeat_interval_s": 0.05}  # default handshake timeout: CI machines can be busy


class NumpyStaging:
    """The StagingHook protocol over a numpy buffer; ``layout`` is bound once the engine exists."""

    def __init__(self, capacity: int, min_direct_run: int = 1 << 62, fail_unstage: bool = False):
        self.buf = np.zeros(capacity, dtype=np.uint8)
        self.region = Region("kvpush.staging", self.buf.ctypes.data, capacity, 1)
        self.layout: KVLayout | None = None
        self.slots = SlotAllocator(capacity, 256)
        self.min_direct_run = min_direct_run
        self.fail_unstage = fail_unstage
        self.calls: dict[str, int] = {"offer": 0, "unstage": 0, "plan": 0, "staged": 0}

    def _rows(self, ids: Sequence[Sequence[int]], off: int) -> list[tuple[int, int, int]]:
        assert self.layout is not None
        addr, lens = stream_extents(self.layout, ids)
        at = self.region.base_addr + off + np.cumsum(lens) - lens
        return list(zip(addr.tolist(), at.tolist(), lens.tolist(), strict=True))

    def offer(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> wire.StagingSlot | None:
        self.calls["offer"] += 1
        assert self.layout is not None
        nbytes = int(stream_extents(self.layout, block_ids)[1].sum())
        off = self.slots.alloc(("recv", request_id), nbytes)
        return None if off is None else wire.StagingSlot(off, nbytes)

    def unstage(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        self.calls["unstage"] += 1
        held = self.slots.get(("recv", request_id))
        if held is None or self.fail_unstage:
            raise LayoutError("no slot")
        for kv, staged, n in self._rows(block_ids, held[0]):
            ctypes.memmove(kv, staged, n)

    def release_recv(self, request_id: str) -> None:
        self.slots.free(("recv", request_id))

    def plan(
        self,
        request_id: str,
        remote: KVLayout,
        remote_staging: Region | None,
        slot: wire.StagingSlot,
        src_groups: Sequence[Sequence[int]],
        dst_groups: Sequence[Sequence[int] | np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray] | None:
        self.calls["plan"] += 1
        assert self.layout is not None
        _, lens = stream_extents(self.layout, src_groups)
        total = int(lens.sum())
        if (
            remote_staging is None
            or total != slot.nbytes
            or total / len(lens) >= self.min_direct_run
        ):
            return None
        off = self.slots.alloc(("push", request_id), total)
        if off is None:
            return None
        for kv, staged, n in self._rows(src_groups, off):
            ctypes.memmove(staged, kv, n)
        self.calls["staged"] += 1
        src = np.array([[self.region.base_addr + off, total, 0]], dtype=np.int64)
        dst = np.array([[remote_staging.base_addr + slot.offset, total, 0]], dtype=np.int64)
        return src, dst

    def release_push(self, request_id: str) -> None:
        self.slots.free(("push", request_id))


class StagedPair:
    """P and D SimEngines over the in-memory transport; extra worker hooks per side."""

    def __init__(
        self,
        p_hook: NumpyStaging | None,
        d_hook: NumpyStaging | None,
        p_kw: dict[str, Any] | None = None,
        d_kw: dict[str, Any] | None = None,
    ) -> None:
        fabric = Fabric()
        self.p = self._engine("P", fabric, p_hook, p_kw or {})
        self.d = self._engine("D", fabric, d_hook, d_kw or {})
        self.d_events: list[tuple[str, str, dict[str, Any]]] = []
        self.p_hook, self.d_hook = p_hook, d_hook

    @staticmethod
    def _engine(
        name: str, fabric: Fabric, hook: NumpyStaging | None, kw: dict[str, Any]
    ) -> SimEngine:
        kw = dict(kw)
        worker = {**FAST, **kw.pop("worker", {})}  # WorkerConfig fields of this side
        spec = SimSpec(name, free_port(), layers=2, num_blocks=256, block_bytes=4096, worker=worker)
        transport = MemoryTransport(fabric, make_agent_name(name, 0))
        eng = SimEngine(spec, transport, staging=hook, **kw)
        if hook is not None:
            hook.layout = eng.worker.layout
        return eng

    def step(self) -> None:
        self.p.step()
        self.d.step()
        self.d_events += self.d.take_events()
        self.p.take_events()

    def push(self, rid: str, n: int) -> None:
        self.d.register(rid, rid, n, "P", "127.0.0.1", self.p.spec.port)
        wait_until(lambda: self.p.worker.snapshot()["pending_registrations"] > 0, 30, self.step)
        self.p.prefill(rid, rid, n)

    def outcome(self, rid: str) -> tuple[str, dict[str, Any]]:
        def ended() -> bool:
            return any(r == rid and k in ("recv", "failed") for k, r, _ in self.d_events)

        wait_until(ended, 30, self.step, f"{rid} to end")
        wait_until(lambda: self.p.held_blocks() == 0, 30, self.step, "P to free its blocks")
        return next((k, info) for k, r, info in self.d_events if r == rid and k != "registered")

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture
def pairs() -> Any:
    made: list[StagedPair] = []

    def make(p_hook: NumpyStaging | None, d_hook: NumpyStaging | None) -> StagedPair:
        made.append(StagedPair(p_hook, d_hook))
        return made[-1]

    yield make
    for pr in made:
        pr.close()


def test_staged_push_is_one_descriptor_and_verified(pairs: Any) -> None:
    pr = pairs(NumpyStaging(1 << 20), NumpyStaging(1 << 20))
    for i, n in enumerate([1, 5, 17]):
        pr.push(f"r{i}", n)
        kind, info = pr.outcome(f"r{i}")
        assert kind == "recv" and info["bad_regions"] == 0, info
    st = pr.p.worker.stats
    assert st["writes"] == st["writes_staged"] == 3 and st["write_descs"] == 3
    assert pr.d_hook is not None and pr.d_hook.calls["unstage"] == 3
    assert len(pr.d_hook.slots) == 0 and pr.p_hook is not None and len(pr.p_hook.slots) == 0


@pytest.mark.parametrize("side", ["P", "D"])
def test_one_side_without_hook_writes_directly(pairs: Any, side: str) -> None:
    hook = NumpyStaging(1 << 20)
    pr = pairs(None, hook) if side == "P" else pairs(hook, None)
    pr.push("r0", 9)
    kind, info = pr.outcome("r0")
    assert kind == "recv" and info["bad_regions"] == 0
    assert pr.p.worker.stats["writes_staged"] == 0
    assert len(hook.slots) == 0  # D's unused slot was freed with the receive


def test_no_room_or_long_runs_fall_back_to_direct(pairs: Any) -> None:
    # 9 blocks x 4 regions x 4 KiB = 144 KiB: more than D's 64 KiB of staging.
    pr = pairs(NumpyStaging(1 << 20), NumpyStaging(64 << 10))
    pr.push("big", 9)
    assert pr.outcome("big")[1]["bad_regions"] == 0
    pr.push("small", 1)
    assert pr.outcome("small")[1]["bad_regions"] == 0
    assert pr.p.worker.stats["writes_staged"] == 1
    # Runs longer than min_direct_run go direct even with a slot.
    pr2 = pairs(NumpyStaging(1 << 20, min_direct_run=1), NumpyStaging(1 << 20))
    pr2.push("r", 3)
    assert pr2.outcome("r")[1]["bad_regions"] == 0
    assert pr2.p.worker.stats["writes_staged"] == 0 and pr2.p_hook.calls["plan"] == 1


def test_failed_scatter_fails_the_receive(pairs: Any) -> None:
    pr = pairs(NumpyStaging(1 << 20), NumpyStaging(1 << 20, fail_unstage=True))
    pr.push("r0", 2)
    kind, info = pr.outcome("r0")
    assert kind == "failed" and "scatter" in info["reason"]
    assert len(pr.d_hook.slots) == 0


def test_wire_staging_field_is_optional_and_omitted() -> None:
    base = wire.PushReg(
        request_id="a",
        decode_engine_id="d",
        decode_host="h",
        decode_port=1,
        decode_tp_size=1,
        local_block_ids=[[1, 2]],
        remote_engine_id="p",
        remote_host="h",
        remote_port=2,
        remote_tp_size=1,
    )
    plain = msgspec.msgpack.decode(wire.encode(base)[len(wire.REG_PREFIX) :])
    assert "staging" not in plain
    got = wire.decode(wire.encode(base))
    assert isinstance(got, wire.PushReg) and got.staging is msgspec.UNSET
    with_slot = msgspec.structs.replace(base, staging=wire.StagingSlot(4096, 64))
    assert wire.decode(wire.encode(with_slot)) == with_slot
    done = wire.StagedDone(request_id="a", tp_size=2)
    assert wire.decode(wire.encode(done)) == done
    with pytest.raises(wire.WireError):
        wire.decode(wire.REG_PREFIX + msgspec.msgpack.encode({**plain, "staging": [-1, 0]}))
