"""Diagnosis only: what posting a small WRITE costs through NIXL's two APIs.

Two NIXL agents in this process (UCX, progress thread off) on 64 blocks of 64 KiB each.
Per round, two random blocks go from one to the other twice, in alternating order: once
as kvpush posts today (descriptor lists built per WRITE, ``initialize_xfer``), once from
descriptor lists prepared once for every block (``make_prepped_xfer`` with block
indices); each then ``transfer``. Timed: from building the request to ``transfer``'s
return (the WRITE's completion is waited for outside the timing).

    PYTHONPATH=. .venv/bin/python scripts/nixl_post_probe.py [--rounds 600]
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

BLOCK, NBLOCKS = 64 * 1024, 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per WRITE")
    args = ap.parse_args()
    logging.getLogger("NIXL").setLevel(logging.WARNING)
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    p, d = nixl_agent("probe-p", cfg), nixl_agent("probe-d", cfg)
    bufs = [np.zeros(BLOCK * NBLOCKS, np.uint8) for _ in range(2)]
    bases = [int(b.ctypes.data) for b in bufs]
    for agent, base, buf in zip((p, d), bases, bufs, strict=True):
        agent.register_memory([(base, buf.nbytes, 0, "")], "DRAM")
    got = p.add_remote_agent(d.get_agent_metadata())
    peer = got.decode() if isinstance(got, bytes) else str(got)
    d.add_remote_agent(p.get_agent_metadata())

    def every_block(base: int) -> list[tuple[int, int, int]]:
        return [(base + i * BLOCK, BLOCK, 0) for i in range(NBLOCKS)]

    local = p.prep_xfer_dlist("", every_block(bases[0]), "DRAM")
    remote = p.prep_xfer_dlist(peer, every_block(bases[1]), "DRAM")

    def rows(base: int, ids: np.ndarray) -> np.ndarray:
        return np.stack([base + ids * BLOCK, np.full(ids.size, BLOCK), np.zeros_like(ids)], 1)

    def post(mode: str, src: np.ndarray, dst: np.ndarray) -> object:
        if mode == "initialize_xfer":
            s = p.get_xfer_descs(rows(bases[0], src), "DRAM")
            t = p.get_xfer_descs(rows(bases[1], dst), "DRAM")
            return p.initialize_xfer("WRITE", s, t, peer, b"probe")
        return p.make_prepped_xfer("WRITE", local, src, remote, dst, b"probe")

    rng = np.random.default_rng(0)
    took: dict[str, list[float]] = {"initialize_xfer": [], "make_prepped_xfer": []}
    modes = list(took)
    for r in range(args.rounds):
        src = rng.choice(NBLOCKS, args.blocks, replace=False)
        dst = rng.choice(NBLOCKS, args.blocks, replace=False)
        for mode in modes if r % 2 else modes[::-1]:
            t0 = time.perf_counter()
            handle = post(mode, src, dst)
            state = p.transfer(handle)
            took[mode].append(time.perf_counter() - t0)
            while state == "PROC":
                state = p.check_xfer_state(handle)
                d.get_new_notifs()
            p.release_xfer_handle(handle)
            d.get_new_notifs()
            if state != "DONE":
                raise SystemExit(f"{mode}: WRITE ended {state}")
    for mode, xs in took.items():
        xs = sorted(xs[len(xs) // 6 :])  # the first sixth warms up
        p50, p10 = xs[len(xs) // 2] * 1e6, xs[len(xs) // 10] * 1e6
        print(f"{mode:18} post p50 {p50:7.1f} us  p10 {p10:7.1f} us")


if __name__ == "__main__":
    main()
