"""Diagnosis only: what a second process's small copies cost, and get, on a GPU that a
compute-bound process keeps busy (one GPU shared by P and D, as in the one-H200 runs).

    python scripts/gpu_share_probe.py [--seconds 2] [--json out.json]

Two processes, each its own CUDA context: ``compute`` multiplies two bf16 8192x8192
matrices over and over (a prefill's forward: one long stream of large kernels), ``copier``
copies between pinned host memory and the device on a non-blocking stream of its own and
waits for each copy (UCX's cuda_copy staging does the same for every fragment of a WRITE
from or into VRAM over TCP). Phases, each ``--seconds`` long:

* ``copies alone``: the copier's latency with the GPU idle;
* ``compute alone``: the product's time with no copier;
* ``both``: the two at once, each process in its own context (P and D on one GPU);
* ``same context``: the copies from a thread of the compute process while it computes
  (what P's own staging copies during its forward see).

Printed: the product's median time per phase, and per copy size and direction the
copies' p50 / p99 latency and how many were done.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time
from typing import Any

SIZES = (4096, 1 << 20)  # a 16-token block of one layer (MQA, bf16); a UCX fragment


def copies(torch: Any, stop: threading.Event | Any, out: dict[str, list[float]]) -> None:
    """Copy each size both ways until ``stop`` is set, each copy waited for."""
    stream = torch.cuda.Stream()  # created non-blocking by torch
    bufs = {
        n: (
            torch.empty(n, dtype=torch.uint8).pin_memory(),
            torch.empty(n, dtype=torch.uint8, device="cuda"),
        )
        for n in SIZES
    }
    for n in SIZES:
        bufs[n][0].random_(0, 255)
    while not stop.is_set():
        for n, (host, dev) in bufs.items():
            for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                stream.synchronize()
                out.setdefault(f"{name} {n}", []).append(time.perf_counter() - t0)


def gemms(torch: Any, stop: threading.Event | Any) -> list[float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    while not stop.is_set():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(8):
            a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 8 / 1000)
    return times


def child(role: str, conn: Any) -> None:
    import torch

    torch.ones(1, device="cuda")
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "quit":
            return
        seconds = float(cmd.split()[1])
        stop = threading.Event()
        threading.Timer(seconds, stop.set).start()
        result: dict[str, Any] = {}
        if role == "copier" or cmd.startswith("same"):
            lat: dict[str, list[float]] = {}
            if role == "compute":  # the copies from a thread of this process
                th = threading.Thread(target=copies, args=(torch, stop, lat))
                th.start()
                result["gemm"] = gemms(torch, stop)
                th.join()
            else:
                copies(torch, stop, lat)
            result["copies"] = lat
        else:
            result["gemm"] = gemms(torch, stop)
        conn.send(result)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "gemm" in result and result["gemm"]:
        out["gemm_ms_p50"] = statistics.median(result["gemm"][2:] or result["gemm"]) * 1e3
    for key, xs in sorted(result.get("copies", {}).items()):
        xs = sorted(xs)
        out[key] = {
            "n": len(xs),
            "p50_us": xs[len(xs) // 2] * 1e6,
            "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    pipes = {}
    for role in ("compute", "copier"):
        mine, theirs = ctx.Pipe()
        ctx.Process(target=child, args=(role, theirs), daemon=True).start()
        pipes[role] = mine
    for p in pipes.values():
        assert p.recv() == "ready"
    s = args.seconds
    phases: dict[str, Any] = {}
    pipes["copier"].send(f"run {s}")
    phases["copies alone"] = summary(pipes["copier"].recv())
    pipes["compute"].send(f"run {s}")
    phases["compute alone"] = summary(pipes["compute"].recv())
    pipes["compute"].send(f"run {s}")
    pipes["copier"].send(f"run {s}")
    both = {**pipes["compute"].recv(), **pipes["copier"].recv()}
    phases["both"] = summary(both)
    pipes["compute"].send(f"same {s}")
    phases["same context"] = summary(pipes["compute"].recv())
    for p in pipes.values():
        p.send("quit")
    for name, row in phases.items():
        print(f"## {name}")
        for key, value in row.items():
            if isinstance(value, dict):
                n, p50, p99 = value["n"], value["p50_us"], value["p99_us"]
                print(f"  {key:>12}: n={n:7d} p50 {p50:9.1f} us  p99 {p99:9.1f} us")
            else:
                print(f"  {key}: {value:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": s, "phases": phases}, f, indent=1)


if __name__ == "__main__":
    main()
