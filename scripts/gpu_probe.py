"""Where a small scattered copy's time goes: launch call vs the copy vs the signal.

    python scripts/gpu_probe.py [--dst 0,1] [--rounds 40] [--json out.json]

One process, P's GPU 0 and D's memory on each ``--dst`` device (peer access on).
Each round copies 16 random 64 KiB blocks into 16 random blocks and signals a
host word (as D's completion lane is); times are from the first CUDA call until
the host reads the word. Methods:

* ``fused``: the peer-copy kernel writing the word from its last block (kvpush's way)
* ``kernel+wv``: the kernel, then cuStreamWriteValue64 of the word
* ``ce+wv``: one cuMemcpyAsync per block (copy engines), then the word
* ``batch+wv``: one cuMemcpyBatchAsync of all blocks, then the word
* ``wv``: the word alone (the floor of one submission)

Gaps between rounds: ``busy`` (the thread spins 2 ms), ``sleep`` (it sleeps 2 ms), ``none``
and ``step`` (2 ms spin, then a small kernel on another stream, waited for: the end of a
forward pass). ``--ipc``: D's memory belongs to a child process and is opened through
CUDA IPC (as between kvpush's P and D).
Every copy is checked once per method and destination.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import statistics
import time
from typing import Any

import cupy
import numpy as np

from kvpush.gpu.driver import Driver, function_of, handle
from kvpush.gpu.peer_copy import _KERNEL, THREADS, TILE

BLOCK = 64 << 10
NBLK = 4096  # 256 MiB each side
N = 16
_u64, _vp, _sz = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t


class MemcpyAttrs(ctypes.Structure):
    _fields_ = [
        ("order", ctypes.c_int),
        ("src_type", ctypes.c_int),
        ("src_id", ctypes.c_int),
        ("dst_type", ctypes.c_int),
        ("dst_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def owner(d: int, pipe: Any) -> None:
    """D: owns the destination memory on GPU ``d``, exports it, idles until told."""
    with cupy.cuda.Device(d):
        dst = cupy.zeros(NBLK * BLOCK // 4, dtype=cupy.int32)
        pipe.send(bytes(cupy.cuda.runtime.ipcGetMemHandle(int(dst.data.ptr))))
        pipe.recv()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dst", default="0")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", default="")
    ap.add_argument("--ipc", action="store_true")
    ap.add_argument("--methods", default="fused,kernel+wv,batch+wv,wv")
    ap.add_argument("--gaps", default="busy,sleep,none,step")
    ap.add_argument("--gap-ms", type=float, default=2.0)
    a = ap.parse_args()
    cu = ctypes.CDLL("libcuda.so.1")
    wv = cu.cuStreamWriteValue64_v2
    wv.argtypes = [_vp, _u64, _u64, ctypes.c_uint]
    cpy = cu.cuMemcpyAsync
    cpy.argtypes = [_u64, _u64, _sz, _vp]
    batch = getattr(cu, "cuMemcpyBatchAsync_v2", None)
    batch_v1 = batch is None
    if batch is None:
        batch = getattr(cu, "cuMemcpyBatchAsync", None)
    drv = Driver(params=8)
    cupy.cuda.Device(0).use()
    src = cupy.random.randint(0, 1 << 30, size=NBLK * BLOCK // 4, dtype=cupy.int32)
    mod = cupy.RawModule(code=_KERNEL)
    kern = mod.get_function("kvpush_piece_copy")
    func = handle(function_of(kern))
    touch_k = cupy.RawKernel(
        r"""extern "C" __global__ void t(const unsigned long long* a) {
        (void)*reinterpret_cast<const volatile unsigned long long*>(a); }""",
        "t",
    )
    atouch_k = cupy.RawKernel(
        r"""extern "C" __global__ void a(const unsigned long long* at) {
        (void)*reinterpret_cast<const volatile unsigned long long*>(at[threadIdx.x]); }""",
        "a",
    )
    wtouch_k = cupy.RawKernel(
        r"""extern "C" __global__ void w(unsigned long long* a) {
        volatile unsigned long long* p = a; *p = *p; }""",
        "w",
    )
    stream = cupy.cuda.Stream(non_blocking=True)
    sh = handle(int(stream.ptr))
    counter = cupy.zeros(1, dtype=cupy.uint64)
    lane = mmap.mmap(-1, 4096)
    words = np.frombuffer(lane, dtype=np.uint64)
    host = ctypes.addressof(ctypes.c_char.from_buffer(lane))
    word_dev = drv.map_host(host, 4096)
    pinned = cupy.cuda.alloc_pinned_memory(8 * (10 + 2 * N))
    table = np.frombuffer(pinned, dtype=np.int64, count=10 + 2 * N)
    tptr = int(table.ctypes.data)
    pinned_w = cupy.cuda.alloc_pinned_memory(8 * (10 + 2 * N))
    warm = np.frombuffer(pinned_w, dtype=np.int64, count=10 + 2 * N)
    wptr = int(warm.ctypes.data)
    rng = np.random.default_rng(1)
    results: dict[str, Any] = {"batch_symbol": "v1" if batch_v1 else "v2"}
    counted = 0
    gen = 0
    other = cupy.cuda.Stream(non_blocking=True)
    scratch = cupy.zeros(1 << 20, dtype=cupy.float32)
    children = []
    for d in [int(x) for x in a.dst.split(",")]:
        if a.ipc:
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=owner, args=(d, child))
            proc.start()
            children.append((proc, parent))
            h = parent.recv()
            dbase = int(cupy.cuda.runtime.ipcOpenMemHandle(h, 1))  # lazy peer access
            dst = cupy.ndarray(
                (NBLK * BLOCK // 4,),
                dtype=cupy.int32,
                memptr=cupy.cuda.MemoryPointer(
                    cupy.cuda.UnownedMemory(dbase, NBLK * BLOCK, None, d), 0
                ),
            )
        else:
            if d != 0:
                cupy.cuda.runtime.deviceEnablePeerAccess(d)
            with cupy.cuda.Device(d):
                dst = cupy.zeros(NBLK * BLOCK // 4, dtype=cupy.int32)
        cupy.cuda.Device(0).use()
        sbase, dbase = int(src.data.ptr), int(dst.data.ptr)
        table[:10] = [sbase, dbase, BLOCK, BLOCK, 0, 0, BLOCK, N, 0, N]

        def run(
            method: str,
            s_ids: np.ndarray,
            d_ids: np.ndarray,
            g: int,
            dbase: int = dbase,
            sbase: int = sbase,
            d: int = d,
        ) -> tuple[float, float]:
            nonlocal counted
            if ":" in method:  # touch D's first block (read or write), wait, then copy
                touch, method = method.split(":")
                at = dbase + int(d_ids[0]) * BLOCK
                with stream:
                    if touch in ("self", "copy"):  # 1 MiB over the link: D's blocks onto
                        # themselves (read and write back), or the copy itself
                        base = dbase if touch == "self" else sbase
                        warm[:10] = [base, dbase, BLOCK, BLOCK, 0, 0, BLOCK, N, 0, N]
                        warm[10 : 10 + N] = d_ids
                        warm[10 + N :] = d_ids if touch == "self" else s_ids
                        drv.args[:8] = (wptr, wptr + 80, TILE, 1, 0, 0, 0, 0)
                        drv.launch(func, (N, 1), THREADS, sh)
                    elif touch == "atouch":  # a word of every destination block
                        addrs = cupy.asarray((dbase + d_ids * BLOCK).astype(np.uint64))
                        atouch_k((1,), (N,), (addrs,))
                    elif touch == "rtouch":
                        touch_k((1,), (1,), (np.uint64(at),))
                    else:
                        wtouch_k((1,), (1,), (np.uint64(at),))
                stream.synchronize()
                if len(method.split("/")) > 1:
                    method, wait_ms = method.split("/")
                    time.sleep(float(wait_ms) * 1e-3)
            if method == "fused":
                table[10 : 10 + N] = d_ids
                table[10 + N :] = s_ids
                target = counted + N
                at = int(counter.data.ptr)
                drv.args[:8] = (tptr, tptr + 80, TILE, 1, at, target, word_dev, g)
                t0 = time.perf_counter()
                drv.launch(func, (N, 1), THREADS, sh)
                counted = target
            elif method == "kernel+wv":
                table[10 : 10 + N] = d_ids
                table[10 + N :] = s_ids
                drv.args[:8] = (tptr, tptr + 80, TILE, 1, 0, 0, 0, 0)
                t0 = time.perf_counter()
                drv.launch(func, (N, 1), THREADS, sh)
                wv(sh, word_dev, g, 0)
            elif method == "ce+wv":
                t0 = time.perf_counter()
                for s, dd in zip(s_ids.tolist(), d_ids.tolist(), strict=True):
                    cpy(dbase + dd * BLOCK, sbase + s * BLOCK, BLOCK, sh)
                wv(sh, word_dev, g, 0)
            elif method == "batch+wv":
                dsts = (_u64 * N)(*(dbase + d_ids * BLOCK).tolist())
                srcs = (_u64 * N)(*(sbase + s_ids * BLOCK).tolist())
                sizes = (_sz * N)(*([BLOCK] * N))
                attrs = MemcpyAttrs(1, 1, 0, 1, d, 0)
                idx = (_sz * 1)(0)
                t0 = time.perf_counter()
                if batch_v1:
                    fail = _sz(0)
                    err = batch(
                        dsts,
                        srcs,
                        sizes,
                        _sz(N),
                        ctypes.byref(attrs),
                        idx,
                        _sz(1),
                        ctypes.byref(fail),
                        sh,
                    )
                else:
                    err = batch(dsts, srcs, sizes, _sz(N), ctypes.byref(attrs), idx, _sz(1), sh)
                if err:
                    raise RuntimeError(f"cuMemcpyBatchAsync: {err}")
                wv(sh, word_dev, g, 0)
            else:  # wv
                t0 = time.perf_counter()
                wv(sh, word_dev, g, 0)
            t1 = time.perf_counter()
            while words[0] != g:
                pass
            t2 = time.perf_counter()
            return (t1 - t0) * 1e6, (t2 - t0) * 1e6

        for method in a.methods.split(","):
            for gap in a.gaps.split(","):
                calls, dones = [], []
                for r in range(a.rounds + 3):
                    s_ids = rng.choice(NBLK, N, replace=False).astype(np.int64)
                    d_ids = rng.choice(NBLK, N, replace=False).astype(np.int64)
                    if gap == "busy":
                        end = time.perf_counter() + a.gap_ms * 1e-3
                        while time.perf_counter() < end:
                            pass
                    elif gap == "sleep":
                        time.sleep(a.gap_ms * 1e-3)
                    elif gap == "step":
                        end = time.perf_counter() + a.gap_ms * 1e-3
                        while time.perf_counter() < end:
                            pass
                        with other:
                            scratch *= 1.0001
                        other.synchronize()
                    gen += 1
                    try:
                        c, dn = run(method, s_ids, d_ids, gen)
                    except Exception as e:
                        results[f"{method}/{d}"] = f"failed: {e}"
                        print(method, d, "failed:", e, flush=True)
                        break
                    if r == 0 and gap == "busy" and method != "wv":
                        stream.synchronize()
                        sv = src.reshape(NBLK, -1)
                        got = cupy.asnumpy(dst.reshape(NBLK, -1)[cupy.asarray(d_ids)])
                        want = cupy.asnumpy(sv[cupy.asarray(s_ids)])
                        ok = bool((got == want).all())
                        results[f"{method}/{d}/verified"] = ok
                        if not ok:
                            print(method, d, "WRONG BYTES", flush=True)
                    if r >= 3:
                        calls.append(c)
                        dones.append(dn)
                if calls:
                    row = {
                        "call_p50": statistics.median(calls),
                        "call_p90": pct(calls, 0.9),
                        "done_p50": statistics.median(dones),
                        "done_p90": pct(dones, 0.9),
                    }
                    results[f"{method}/{d}/{gap}"] = row
                    print(
                        f"0->{d} {method:10s} gap={gap:5s} call {row['call_p50']:7.1f} / "
                        f"{row['call_p90']:7.1f}  done {row['done_p50']:7.1f} / "
                        f"{row['done_p90']:7.1f} us",
                        flush=True,
                    )
        del dst
    for proc, pipe in children:
        pipe.send("quit")
        proc.join(10)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
