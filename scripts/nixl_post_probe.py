"""Diagnosis only: what posting a small WRITE costs through NIXL's two APIs, and (with
``--large-mib``) how long each NIXL call takes while a large WRITE moves.

Two NIXL agents in this process (UCX, progress thread off) on 64 blocks of 64 KiB each.
Per round, two random blocks go from one to the other twice, in alternating order: once
as kvpush posts today (descriptor lists built per WRITE, ``initialize_xfer``), once from
descriptor lists prepared once for every block (``make_prepped_xfer`` with block
indices); each then ``transfer``. Timed: from building the request to ``transfer``'s
return (the WRITE's completion is waited for outside the timing).

    PYTHONPATH=. .venv/bin/python scripts/nixl_post_probe.py [--rounds 600]

``--large-mib N``: one scattered WRITE of N MiB in 64 KiB blocks, three times; prints the
post's time and each ``check_xfer_state`` call's: UCX progresses inside it (the GIL is
released meanwhile), over TCP sending until the socket buffer is full, so
``UCX_TCP_SNDBUF`` bounds a call; with shared memory the post itself copies everything.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

BLOCK = 64 * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--blocks", type=int, default=2, help="blocks per WRITE")
    ap.add_argument("--large-mib", type=int, default=0, help="the GIL-hold measurement")
    args = ap.parse_args()
    logging.getLogger("NIXL").setLevel(logging.WARNING)
    from nixl._api import nixl_agent, nixl_agent_config

    nblocks = max(64, args.large_mib * 16)
    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    p, d = nixl_agent("probe-p", cfg), nixl_agent("probe-d", cfg)
    bufs = [np.zeros(BLOCK * nblocks, np.uint8) for _ in range(2)]
    bases = [int(b.ctypes.data) for b in bufs]
    for agent, base, buf in zip((p, d), bases, bufs, strict=True):
        agent.register_memory([(base, buf.nbytes, 0, "")], "DRAM")
    got = p.add_remote_agent(d.get_agent_metadata())
    peer = got.decode() if isinstance(got, bytes) else str(got)
    d.add_remote_agent(p.get_agent_metadata())

    def rows(base: int, ids: np.ndarray) -> np.ndarray:
        return np.stack([base + ids * BLOCK, np.full(ids.size, BLOCK), np.zeros_like(ids)], 1)

    if args.large_mib:
        ids = np.random.default_rng(0).permutation(nblocks)
        for _ in range(3):
            s = p.get_xfer_descs(rows(bases[0], ids), "DRAM")
            t = p.get_xfer_descs(rows(bases[1], ids[::-1].copy()), "DRAM")
            handle = p.initialize_xfer("WRITE", s, t, peer, b"probe")
            t0 = time.perf_counter()
            state = p.transfer(handle)
            post = time.perf_counter() - t0
            calls = []
            while state == "PROC":
                t0 = time.perf_counter()
                state = p.check_xfer_state(handle)
                calls.append(time.perf_counter() - t0)
                d.get_new_notifs()
            p.release_xfer_handle(handle)
            calls.sort()
            mid = calls[len(calls) // 2] * 1e3 if calls else 0.0
            top = calls[-1] * 1e3 if calls else 0.0
            print(f"{args.large_mib} MiB: post {post * 1e3:.2f} ms, {len(calls)} checks,"
                  f" p50 {mid:.3f} ms, max {top:.3f} ms, state {state}")  # fmt: skip
        return

    def every_block(base: int) -> list[tuple[int, int, int]]:
        return [(base + i * BLOCK, BLOCK, 0) for i in range(nblocks)]

    local = p.prep_xfer_dlist("", every_block(bases[0]), "DRAM")
    remote = p.prep_xfer_dlist(peer, every_block(bases[1]), "DRAM")

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
        src = rng.choice(nblocks, args.blocks, replace=False)
        dst = rng.choice(nblocks, args.blocks, replace=False)
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
