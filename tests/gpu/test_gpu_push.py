"""The core's push over torch tensors in two processes: VRAM when CUDA is present.

Skipped without torch (CI). Each case runs on ("cpu", "cpu") wherever torch and
NIXL are installed (DRAM, the torch copy backend), on ("cuda:0", "cuda:0") with
one GPU and on ("cuda:0", "cuda:1") with two. D checks every byte on its device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvpush_bench.gpu.engine import GpuSpec  # noqa: E402
from kvpush_bench.gpu.process import GpuProcess  # noqa: E402
from tests.conftest import free_port  # noqa: E402

pytestmark = pytest.mark.integration

PAIRS = [("cpu", "cpu")]
if torch.cuda.is_available():
    PAIRS.append(("cuda:0", "cuda:0"))
    if torch.cuda.device_count() >= 2:
        PAIRS.append(("cuda:0", "cuda:1"))

FAST = {"poll_interval_s": 5e-5, "max_poll_interval_s": 5e-4, "heartbeat_interval_s": 0.2}
BLOCK = 16384
REGIONS = 4


class Pair:
    def __init__(self, p_dev: str, d_dev: str) -> None:
        self.p, self.d = GpuProcess(p_dev), GpuProcess(d_dev)
        self.n = 0

    def setup(self, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        self.p_port, self.d_port = free_port(), free_port()
        common = {"regions": REGIONS, "num_blocks": 512, "block_bytes": BLOCK, "worker": FAST}
        common.update(kw)
        p = self.p.call("setup", GpuSpec("P", self.p_port, device=self.p.device, seed=1, **common))
        d = self.d.call("setup", GpuSpec("D", self.d_port, device=self.d.device, seed=2, **common))
        return p, d

    def push(self, n_blocks: int) -> str:
        self.n += 1
        rid = f"r{self.n}"
        self.d.send("register", f"{rid}-d", rid, n_blocks, "P", "127.0.0.1", self.p_port, None)
        self.p.send("prefill", f"{rid}-p", rid, n_blocks, None)
        return rid

    def check(self, rid: str, n_blocks: int) -> None:
        ev = self.d.wait_for(lambda e: e[0] in ("recv", "failed") and e[1] == f"{rid}-d", 60)
        assert ev[0] == "recv", ev
        assert ev[2]["bad_regions"] == 0, ev
        assert ev[2]["bytes"] == n_blocks * REGIONS * BLOCK
        self.p.wait_for(lambda e: e[0] == "sent" and e[1] == f"{rid}-p", 30)

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()


@pytest.fixture(scope="module", params=PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    pr = Pair(*request.param)
    yield pr
    pr.stop()


SIZES = [1, 3, 17, 64, 200]


@pytest.mark.parametrize("writer", ["thread", "inline"])
def test_direct_writes_verified(pair: Pair, writer: str) -> None:
    pair.setup(worker={**FAST, "writer": writer})
    rids = [(pair.push(n), n) for n in SIZES]
    for rid, n in rids:
        pair.check(rid, n)
    st = pair.p.call("stats")
    assert st["writes"] == len(SIZES) and st["writes_staged"] == 0
    assert st["write_descs"] > len(SIZES) * REGIONS  # scattered: many runs per request


def test_staged_writes_one_descriptor_each(pair: Pair) -> None:
    p, _ = pair.setup(staging_bytes=64 << 20, min_direct_run=1 << 40)
    rids = [(pair.push(n), n) for n in SIZES]
    for rid, n in rids:
        pair.check(rid, n)
    st = pair.p.call("stats")
    assert st["writes"] == st["writes_staged"] == len(SIZES), (st, p)
    assert st["write_descs"] == len(SIZES)
    d = pair.d.call("stats")
    assert d["staging_unstaged"] == len(SIZES) and d["staging_unstaged_bytes"] == sum(
        n * REGIONS * BLOCK for n in SIZES
    )


def test_bounded_staging_many_concurrent(pair: Pair) -> None:
    # 2 MiB of staging holds a few requests at a time: the rest go direct.
    pair.setup(staging_bytes=2 << 20, min_direct_run=1 << 40, num_blocks=2048)
    sizes = [1 + (i * 7) % 40 for i in range(40)]
    rids = [(pair.push(n), n) for n in sizes]
    for rid, n in rids:
        pair.check(rid, n)
    st = pair.p.call("stats")
    assert st["writes"] == len(sizes)
    assert 0 < st["writes_staged"] < len(sizes), st
    d = pair.d.call("stats")
    assert d["staging_offered"] + d.get("staging_offer_no_room", 0) == len(sizes)


def test_long_runs_go_direct(pair: Pair) -> None:
    # Contiguous blocks: one run per region, longer than min_direct_run: no staging.
    pair.setup(staging_bytes=64 << 20, min_direct_run=2 * BLOCK, scattered=False)
    rids = [(pair.push(n), n) for n in (4, 8)]
    for rid, n in rids:
        pair.check(rid, n)
    st = pair.p.call("stats")
    assert st["writes_staged"] == 0 and st["staging_direct_long_runs"] == 2, st


@pytest.mark.parametrize("writer", ["thread", "inline"])
def test_ipc_copies_one_kernel_per_transfer(pair: Pair, writer: str) -> None:
    if pair.p.device == "cpu":
        pytest.skip("CUDA IPC exists on CUDA devices only (the CPU pair writes through NIXL)")
    pair.setup(peer_copy=True, worker={**FAST, "writer": writer})
    rids = [(pair.push(n), n) for n in SIZES]
    for rid, n in rids:
        pair.check(rid, n)
    st = pair.p.call("stats")
    assert st.get("writes", 0) == 0 and st["peer_copy_copies"] == len(SIZES), st
    assert st["peer_copy_mapped"] == 1 and st["copies_done"] == len(SIZES), st
    # D's GPU is another: its link was woken (into D's scratch, never its KV: D checked
    # every byte) at least for the first copy; on one GPU there is no link to wake.
    wakes = st.get("peer_copy_wakes", 0)
    assert wakes >= 1 if pair.p.device != pair.d.device else wakes == 0, st
    # Every receive ended by its lane word, written by the copy kernel itself.
    assert pair.d.call("stats")["lane_done"] == len(SIZES)


def test_ipc_without_lane_notifies_after_the_copy(pair: Pair) -> None:
    """No lane word: the copy is polled (never waited for) and P notifies over NIXL."""
    if pair.p.device == "cpu":
        pytest.skip("CUDA IPC exists on CUDA devices only (the CPU pair writes through NIXL)")
    pair.setup(peer_copy=True, worker={**FAST, "lane_slots": 0})
    rids = [(pair.push(n), n) for n in SIZES]
    for rid, n in rids:
        pair.check(rid, n)
    st = pair.p.call("stats")
    assert st["peer_copy_copies"] == len(SIZES) == st["copies_done"], st
    assert pair.d.call("stats").get("lane_done", 0) == 0


@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "write"])
def test_eager_prefill_is_read_only_after_its_writes(pair: Pair, ipc: bool) -> None:
    """P hands its blocks over right after queueing their writes behind 20 ms of device
    work (StagedBlocks.after, no sync): the copy is queued behind the event, the WRITE
    waits for it. Blocks are reused, so anything read early holds another request's KV."""
    if pair.p.device == "cpu":
        pytest.skip("an event to queue behind exists on CUDA devices only")
    pair.setup(peer_copy=ipc, eager=True, prefill_us=20_000, worker={**FAST, "writer": "inline"})
    for n in (3, 17):
        rid = pair.push(n)
        pair.check(rid, n)
    st = pair.p.call("stats")
    if ipc:
        assert st["peer_copy_copies"] == 2 and st["peer_copy_follows"] == 2, st
    else:
        assert st["writes"] == 2 and "peer_copy_follows" not in st, st
