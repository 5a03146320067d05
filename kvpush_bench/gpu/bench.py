"""Transport benchmark: raw NIXL WRITE vs kvpush direct vs kvpush staged, in one run.

    python -m kvpush_bench.gpu.bench --p-device cuda:0 --d-device cuda:0 --json out.json

Two child processes play P and D. For each block size, ``--total`` bytes are
moved as ``total / block`` blocks whose source and destination ids are random
permutations (both sides scattered), median of ``--reps`` timed rounds after
one warm-up round; D checks every byte of every round. Then the KV-ready
latency of a ``--lat-blocks``-block request (64 KiB blocks).

raw: one NIXL WRITE of one descriptor per block, timed on P from building the
descriptors until DONE. kvpush: the core's push through PushWorker, timed from
P's engine handing the finished blocks to its worker (``start_step``) until
D's engine sees the request in ``finished_recving`` (after the scatter, for
staged). ``ceiling``: a contiguous device copy of ``--total`` bytes (P's device
into D's device) with torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvpush.deploy.servers import free_port
from kvpush_bench.gpu.engine import GpuSpec
from kvpush_bench.gpu.process import GpuProcess

GIB = 1 << 30
BENCH_WORKER = {  # the writer polls NIXL every 10-50 us while transfers are in flight
    "poll_interval_s": 1e-5,
    "max_poll_interval_s": 5e-5,
    "match_poll_s": 1e-4,
}
FORCE_STAGED = 1 << 62  # min_direct_run: stage every transfer
# Marks of the traced writer (seconds after P's engine called start_step).
STAGES = (
    "pickup",  # P's writer took the finished blocks
    "push",  # matched, building the WRITE
    "gather",  # staged: plan (gather kernel) started
    "gathered",  # staged: gathered into P's staging
    "write",  # NIXL WRITE called (ipc: the copy started)
    "copied",  # ipc: the copy is launched (done, when waited for: no lane word)
    "notify",  # ipc: the completion is being sent
    "posted",  # NIXL WRITE posted
    "notif",  # D's writer got the completion notification
    "scatter",  # staged: scatter started
    "polled",  # D's worker read its lane for the last time before it held the word
    "seen",  # D's worker read the word
    "ready",  # D's worker reports the KV received
    "engine",  # D's engine saw it in finished_recving
)


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


def summary(times: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(times)
    return {"median_s": med, "gib_s": nbytes / med / GIB, "times_s": times}


def lat_summary(lat: list[float]) -> dict[str, Any]:
    lat_us = sorted(x * 1e6 for x in lat)
    return {
        "p50_us": statistics.median(lat_us),
        "p90_us": lat_us[int(0.9 * (len(lat_us) - 1))],
        "min_us": lat_us[0],
        "n": len(lat_us),
    }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.rng = np.random.default_rng(args.seed)
        kw = {"loop_sleep_s": args.loop_sleep, "switch_s": args.switch}
        self.P = GpuProcess(args.p_device, **kw)
        self.D = GpuProcess(args.d_device, **kw)
        self.p_port = 0
        self._mode = ""  # the latency mode being run (for --profile)

    def close(self) -> None:
        self.P.stop()
        self.D.stop()

    # ---- raw NIXL --------------------------------------------------------------------------

    def raw(self, block: int, n_blocks: int, writes: int, latency: bool) -> dict[str, Any]:
        P, D, total = self.P, self.D, self.a.total
        n_all = total // block
        p = P.call("raw_open", "P", total)
        d = D.call("raw_open", "D", total)
        peer = P.call("raw_connect", d["metadata"])["peer"]
        D.call("raw_connect", p["metadata"])
        plan = []
        for i in range(writes):
            src = self.rng.permutation(n_all)[:n_blocks]
            dst = self.rng.permutation(n_all)[:n_blocks]
            plan.append((src, dst, block, d["base"], d["dev"], f"w{i}".encode()))
        key = f"raw-{block}-{n_blocks}"
        last_src, last_dst = plan[-1][0], plan[-1][1]
        P.call("raw_fill", last_src.tolist(), block, key, False)
        D.call("raw_fill", last_dst.tolist(), block, key, True)
        D.send("raw_wait", writes, 300.0)
        out = P.call("raw_write", peer, plan, timeout=600)["writes"]
        notifs = D.wait_for(lambda e: e[0] == "raw" and e[1] == "notifs", 300, "notifs")[2]
        ok = D.call("raw_verify", last_dst.tolist(), block, key)["ok"]
        arrived = {m.decode(): t for m, t in notifs["notifs"]}
        res: dict[str, Any] = {"verified": bool(ok), "descriptors": n_blocks}
        if latency:
            lat = [arrived[f"w{i}"] - w["t0"] for i, w in enumerate(out) if f"w{i}" in arrived]
            res.update(lat_summary(lat[1:]))
        else:
            res.update(summary([w["total_s"] for w in out[1:]], n_blocks * block))
            res["post_s"] = statistics.median(w["post_s"] for w in out[1:])
        return res

    # ---- kvpush ----------------------------------------------------------------------------

    def setup(self, block: int, staging: int, backend: str, bind: bool, writer: str) -> str | None:
        n_all = self.a.total // block
        common: dict[str, Any] = {
            "regions": 1,
            "num_blocks": n_all,
            "block_bytes": block,
            "worker": {**BENCH_WORKER, "writer": writer},
            "staging_bytes": staging,
            "staging_backend": backend if backend != "ipc" else "auto",
            "peer_copy": backend == "ipc",
            "min_direct_run": FORCE_STAGED,
            "trace": True,
            "bind_thread": bind,
        }
        self.p_port, d_port = free_port(), free_port()
        p_spec = GpuSpec(
            "P",
            self.p_port,
            device=self.a.p_device,
            prefill_us=self.a.prefill_us,
            eager=bool(self.a.eager),
            **common,
        )
        p = self.P.call("setup", p_spec)
        self.D.call("setup", GpuSpec("D", d_port, device=self.a.d_device, **common))
        return p.get("copier")

    def round(self, rid: str, src: np.ndarray, dst: np.ndarray) -> dict[str, float]:
        """One push; its stage times (s) from P's start_step (see STAGES) and D's verdict."""
        P, D = self.P, self.D
        D.send("register", f"{rid}-d", rid, len(dst), "P", "127.0.0.1", self.p_port, dst.tolist())
        deadline = time.monotonic() + 60
        while P.call("pending")["n"] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the registration never reached P")
            time.sleep(0.001)
        P.send("prefill", f"{rid}-p", rid, len(src), src.tolist())
        ev = D.wait_for(lambda e: e[0] in ("recv", "failed") and e[1] == f"{rid}-d", 300, "recv")
        if ev[0] != "recv":
            raise RuntimeError(f"{rid}: {ev}")
        pushed = P.wait_for(lambda e: e[0] == "pushed" and e[1] == f"{rid}-p", 60, "pushed")[2]
        t0 = pushed["t"]
        sent = P.wait_for(lambda e: e[0] == "sent" and e[1] == f"{rid}-p", 60, "sent")[2]
        marks = {**sent, **ev[2]}
        out = {"bad": float(ev[2]["bad_regions"]), "engine": ev[2]["t"] - t0}
        out["late"] = float(pushed.get("late", False))
        for name in STAGES[:-1]:
            if name in marks:
                out[name] = marks[name] - t0
        return out

    def kvpush(
        self,
        block: int,
        n_blocks: int,
        rounds: int,
        staging: int,
        backend: str,
        latency: bool,
        tag: str = "",
        bind: bool = True,
        writer: str = "thread",
    ) -> dict[str, Any]:
        copier = self.setup(block, staging, backend, bind, writer)
        n_all = self.a.total // block
        runs, bad = [], 0.0
        mode, _, side = self.a.profile.partition(":")
        proc = self.D if side == "D" else self.P
        profile = latency and mode and tag == "t0" and mode == self._mode
        for i in range(rounds):
            if profile and i == 1:  # the engine thread over the timed rounds
                proc.call("profile", "start")
            src = self.rng.permutation(n_all)[:n_blocks]
            dst = self.rng.permutation(n_all)[:n_blocks]
            r = self.round(f"b{block}-n{n_blocks}-s{staging}-{backend}-{tag}-{i}", src, dst)
            bad += r["bad"]
            if i:
                runs.append(r)
        if profile:
            text = proc.call("profile", "stop", 45)["text"]
            print(f"profile of {side or 'P'} ({mode}, {rounds - 1} rounds):\n{text}", flush=True)
        st = self.P.call("stats")
        res: dict[str, Any] = {
            "verified": bad == 0,
            "copier": copier,
            "writes_staged": st.get("writes_staged", 0),
            "descriptors": st.get("write_descs", 0) // max(1, st.get("writes", 1)),
        }
        if "peer_copy_us" in st:
            res["copy_us"] = st["peer_copy_us"]  # table / launch / wait, medians
        # A late round (--eager) has no start to measure from: left out of the figures.
        late = sum(r["late"] for r in runs)
        runs = [r for r in runs if not r["late"]] or runs
        # KV ready = D's worker reports it (after the scatter); engine = D's engine saw it.
        ready = [r.get("ready", r["engine"]) for r in runs]
        res.update(lat_summary(ready) if latency else summary(ready, n_blocks * block))
        engine = [r["engine"] for r in runs]
        res["engine"] = lat_summary(engine) if latency else summary(engine, n_blocks * block)
        res["late_rounds"] = int(late)  # --eager: see GpuEngine.step
        res["stages_us"] = {
            k: statistics.median(r[k] for r in runs) * 1e6
            for k in STAGES
            if all(k in r for r in runs)
        }
        return res

    def modes(self, latency: bool = False) -> list[tuple[str, int, str, bool, str]]:
        """(name, staging bytes, copy backend, bind the writer thread to the device, writer)."""
        out = [("direct", 0, "auto", True, "thread")]
        if self.a.ipc:
            out.append(("ipc", 0, "ipc", True, "thread"))  # one kernel into D's memory
        if self.a.inline:  # no writer thread: the engine thread does the work in its step
            out.append(("direct-inline", 0, "auto", True, "inline"))
            if self.a.ipc:
                out.append(("ipc-inline", 0, "ipc", True, "inline"))
        for b in filter(None, self.a.backends.split(",")):
            out.append((f"staged-{b}", self.a.total, b, True, "thread"))
        if latency and self.a.unbound:
            out.append(("direct-unbound", 0, "auto", False, "thread"))
            out.append(("staged-unbound", self.a.total, "auto", False, "thread"))
        only = set(filter(None, self.a.only.split(",")))
        return [m for m in out if m[0] in only] if only else out

    # ---- the whole run ---------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        a = self.a
        res: dict[str, Any] = {"config": vars(a), "throughput": [], "latency": {}}
        if a.p_device.startswith("cuda"):
            c = self.P.call("ceiling", a.total, a.d_device, a.reps, timeout=300)
            res["ceiling_gib_s"] = c["gib_s"]
            print(f"ceiling (contiguous copy {a.p_device} -> {a.d_device}): {c['gib_s']:.0f} GiB/s")
            k = self._guard(self.P.call, "kernels", a.total, parse_size(a.lat_block), 10)
            res["kernels"] = k
            print("copy kernels alone (GiB/s; prepare ms):", json.dumps(k, default=str))
        for size in a.sizes.split(","):
            block = parse_size(size)
            n = a.total // block
            row: dict[str, Any] = {"block": block}
            row["raw"] = self._guard(self.raw, block, n, a.reps + 1, False)
            for name, staging, backend, bind, writer in self.modes():
                row[name] = self._guard(
                    self.kvpush, block, n, a.reps + 1, staging, backend, False, "", bind, writer
                )
            res["throughput"].append(row)
            print(self._row(row), flush=True)
        lb = parse_size(a.lat_block)
        res["latency"]["block"] = lb
        res["latency"]["blocks"] = a.lat_blocks
        nl, rl = a.lat_blocks, a.lat_reps + 1
        res["latency"]["raw"] = self._guard(self.raw, lb, nl, rl, True)
        for i, tune in enumerate(a.lat_tunes.split(",")):
            sleep_s, switch_s, *rest = tune.split(":")
            spin = bool(rest and rest[0] == "spin")
            for proc in (self.P, self.D):
                proc.call("tune", float(sleep_s), float(switch_s), spin)
            for name, staging, backend, bind, writer in self.modes(latency=True):
                key = name if i == 0 else f"{name}@{tune}"
                self._mode = name
                tag = f"t{i}"
                got = self._guard(
                    self.kvpush, lb, nl, rl, staging, backend, True, tag, bind, writer
                )
                res["latency"][key] = {**got, "tune": tune}
        return res

    def _guard(self, fn: Any, *args: Any) -> dict[str, Any]:
        try:
            out: dict[str, Any] = fn(*args)
            return out
        except Exception as e:  # one failing mode must not lose the others
            print(f"  failed: {e!r}"[:2000], file=sys.stderr, flush=True)
            return {"error": repr(e)[:4000]}

    def _row(self, row: dict[str, Any]) -> str:
        cells = [f"{fmt_size(row['block']):>8}"]
        for name in ["raw", *[m[0] for m in self.modes()]]:
            r = row.get(name, {})
            if "gib_s" in r:
                bad = "" if r.get("verified") else " UNVERIFIED"
                cells.append(f"{name} {r['gib_s']:8.1f}{bad}")
            else:
                cells.append(f"{name}    error")
        return " | ".join(cells)


def print_tables(res: dict[str, Any], modes: list[str]) -> None:
    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        if key not in r:
            return "err"
        return format(r[key], fmt) + ("" if r.get("verified") else "!")

    print("\nthroughput, GiB/s, median (kvpush: KV ready at D's worker / seen by D's engine):")
    print(" | ".join(["block", *modes]))
    for row in res["throughput"]:
        cells = [fmt_size(row["block"])]
        for m in modes:
            r = row.get(m, {})
            eng = r.get("engine", {}).get("gib_s")
            cells.append(cell(r, "gib_s", ".1f") + (f" / {eng:.1f}" if eng else ""))
        print(" | ".join(cells))
    lat = res["latency"]
    print(f"\nKV-ready latency, {lat['blocks']} blocks of {fmt_size(lat['block'])}, p50 / p90 us")
    print(
        "(kvpush: p50 us of each stage after P's start_step,"
        " see STAGES in kvpush_bench/gpu/bench.py)"
    )
    for m, r in lat.items():
        if not isinstance(r, dict):
            continue
        st = " ".join(f"{k}={v:.0f}" for k, v in r.get("stages_us", {}).items())
        eng = r.get("engine", {}).get("p50_us")
        extra = f"  engine p50 {eng:.0f}  stages {st}" if eng else ""
        if r.get("late_rounds"):
            extra += f"  late rounds {r['late_rounds']}"
        print(f"{m}: {cell(r, 'p50_us', '.0f')} / {cell(r, 'p90_us', '.0f')}{extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p-device", default="cuda:0")
    ap.add_argument("--d-device", default="cuda:0")
    ap.add_argument("--sizes", default="64K,256K,1M,16M")
    ap.add_argument("--total", type=parse_size, default=GIB)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", default="cupy,torch", help="staged copy backends to run")
    ap.add_argument("--ipc", type=int, default=1, help="also run the CUDA IPC direct copy")
    ap.add_argument("--inline", type=int, default=1, help="also run writer=inline workers")
    ap.add_argument("--lat-block", default="64K")
    ap.add_argument("--lat-blocks", type=int, default=16)
    ap.add_argument("--lat-reps", type=int, default=50)
    ap.add_argument("--loop-sleep", type=float, default=0.0, help="engine loop sleep (s)")
    ap.add_argument("--switch", type=float, default=5e-5, help="sys.setswitchinterval in children")
    ap.add_argument(
        "--lat-tunes",
        default="0:5e-5,1e-4:5e-3,5e-5:1e-5",
        help="latency runs per engine-loop sleep:GIL switch interval (s)[:spin], comma-separated"
        " (spin: both engines step between requests too, as under load)",
    )
    ap.add_argument("--unbound", type=int, default=1, help="also time unbound writer threads")
    ap.add_argument("--only", default="", help="run only these kvpush modes (comma-separated)")
    ap.add_argument(
        "--prefill-us", type=float, default=0.0, help="P's prefill keeps the GPU busy this long"
    )
    ap.add_argument(
        "--eager",
        type=int,
        default=0,
        help="P hands its blocks over with an event behind their writes, not after a sync"
        " (times then start when the event first reports done)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile", default="", help="cProfile P's (MODE) or D's (MODE:D) engine thread"
    )
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_bench.json"))
    args = ap.parse_args(argv)
    bench = Bench(args)
    try:
        res = bench.run()
    finally:
        bench.close()
    modes = ["raw", *[m[0] for m in bench.modes()]]
    print_tables(res, modes)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
