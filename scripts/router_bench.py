#!/usr/bin/env python3
"""What a router adds to time-to-first-token: kvpush router and vllm-router side by side.

Both routers front the same two fake upstreams (``upstream``, each its own process, see
router_bench_io.py): a prefiller that answers at once (``--prefill-ms``, 0 by default)
and a decoder that streams ``--tokens`` events ``--gap-ms`` apart, the first at once,
from precomputed bytes. The decoder stamps its first event with when it had the request
and when it wrote that event (CLOCK_MONOTONIC, one clock for every process here), so
each request's added latency is the client's TTFT minus the decoder's, split into
client->D (send to D's receipt) and D->client (D's first write to the client's receipt).
``direct`` (the client straight to the fake decoder) is what the harness adds by itself.

Closed loop: each stream sends its next request when the previous one ended, after a
random pause of up to one gap; streams start spread over one stream's length. Every
level begins with one uncounted request per stream (connections opened), the same for
every contender; every measured request is counted, failures too. The router runs on
``--router-cpus``, the client and upstreams on ``--harness-cpus`` (taskset). CPU per
request is each process group's scheduler time (/proc/*/task/*/schedstat) over the
level divided by its requests.

    python scripts/router_bench.py --levels 1,64,256 --json out.json --plot out.png

Not covered: real vLLM upstreams (their TTFT and the transfer), a prefill that takes time
(with one, vllm-router's sequential legs add the whole prefill before the decode leg starts,
kvpush's router does not; see docs/benchmarks.md), other machines than this one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from router_bench_io import install_uvloop, run_level, serve_upstream

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpush_bench import png  # noqa: E402

LOOP = install_uvloop()  # the client's loop (the upstreams install it themselves)


# ---- processes -------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout:g}s") from None
            time.sleep(0.2)


def start(argv: list[str], log: Path, cwd: str | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
    )


def router_cwd(name: str) -> str | None:
    """``kvpush@DIR``: kvpush's router started in DIR, so that `python -m` imports kvpush
    from there (ahead of PYTHONPATH): an A/B of two trees in one run."""
    return os.path.abspath(name.split("@", 1)[1]) if name.startswith("kvpush@") else None


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def task_seconds(pid: int | str) -> float:
    """CPU time of every thread of process `pid`, from the scheduler's own account
    (/proc/PID/task/TID/schedstat, in ns): exact, where utime/stime are sampled at the
    clock tick and charge a process woken by 10 ms timers unevenly."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total / 1e9


def cpu_seconds(pgid: int) -> float:
    """CPU time of every live process in group ``pgid`` (a launcher and the binary it
    runs both count)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of stat: the process group
                total += task_seconds(entry.name)
        except OSError:
            continue  # gone meanwhile
    return total


def router_argv(
    name: str, port: int, p_url: str, d_url: str, cprofile: str | None = None
) -> list[str]:
    if name.split("@")[0] == "kvpush":
        prof = ["-m", "cProfile", "-o", cprofile] if cprofile else []
        argv = [sys.executable, *prof, "-m", "kvpush.cli", "router", "--port", str(port)]
        return argv + ["--prefill", p_url, "--decode", d_url]
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
    argv = [exe, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    return argv + ["--prefill", p_url, "--decode", d_url, "--log-level", "warning"]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(results: list[dict[str, Any]], cpu: dict[str, float], secs: float) -> dict[str, Any]:
    """Added TTFT = (client first event - send) - (D's first write - D's receipt), split
    into to_d (client send -> D has the request) and from_d (D's first write -> client)."""
    ok = [r for r in results if r["ok"]]
    added = [((r["first"] - r["send"]) - (r["d_first"] - r["d_recv"])) * 1e3 for r in ok]
    to_d = [(r["d_recv"] - r["send"]) * 1e3 for r in ok]
    from_d = [(r["first"] - r["d_first"]) * 1e3 for r in ok]
    errors = [r["error"] for r in results if not r["ok"]]
    n = max(1, len(results))
    out: dict[str, Any] = {
        "requests": len(results),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "seconds": secs,
        "added_ms_p50": pct(added, 0.5),
        "added_ms_p99": pct(added, 0.99),
        "added_ms_mean": statistics.fmean(added) if added else None,
        "to_d_ms_p50": pct(to_d, 0.5),
        "to_d_ms_p99": pct(to_d, 0.99),
        "from_d_ms_p50": pct(from_d, 0.5),
        "from_d_ms_p99": pct(from_d, 0.99),
    }
    for who, seconds in cpu.items():
        out[f"{who}_cpu_ms_per_request"] = seconds * 1e3 / n
    return out


def brief(cell: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)

    keys = ("requests", "failed", "added_ms_p50", "added_ms_p99", "to_d_ms_p50", "from_d_ms_p50")
    cpu = {k.split("_cpu")[0]: cell[k] for k in cell if k.endswith("cpu_ms_per_request")}
    return (
        " ".join(f"{k}={f(cell[k])}" for k in keys)
        + " cpu_ms/req "
        + " ".join(f"{k}={v:.2f}" for k, v in cpu.items())
    )


def cpu_now(groups: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each process group, and of this process (the client)."""
    out = {"client": task_seconds(os.getpid())}
    for who, pgid in groups.items():
        out[who] = cpu_seconds(pgid)
    return out


def bench_router(
    name: str, args: argparse.Namespace, urls: dict[str, str], fakes: dict[str, int], logs: Path
) -> Any:
    """One contender over every level. ``direct``: the client to the fake decoder with no
    router, the floor this harness (client, upstreams, one machine) measures by itself."""
    proc = None
    url = urls["decode"]
    if name != "direct":
        port = free_port()
        argv = router_argv(name, port, urls["prefill"], urls["decode"], args.cprofile)
        log = logs / f"router-{name.replace('/', '_')}.log"
        proc = start(pinned(argv, args.router_cpus), log, router_cwd(name))
        url = f"http://127.0.0.1:{port}"
    groups = dict(fakes, **({"router": proc.pid} if proc else {}))
    try:
        if proc is not None:
            wait_http(url + "/health", 120, proc)
        # the same warm-up for all
        warm = asyncio.run(run_level(url, 1, 20, args.tokens, prompt_tokens=args.prompt_tokens))
        out: dict[str, Any] = {"warmup_failed": sum(not r["ok"] for r in warm)}
        for streams in args.levels:
            # One request per stream first, not counted: every contender opens its
            # connections (and the router its upstream ones) before the measured part.
            warm = asyncio.run(
                run_level(url, streams, streams, args.tokens, prompt_tokens=args.prompt_tokens)
            )
            out["warmup_failed"] += sum(not r["ok"] for r in warm)
            n = max(args.min_requests, args.per_stream * streams)
            spread = args.tokens * args.gap_ms / 1e3 if args.stagger else 0.0
            pause = args.gap_ms / 1e3 if args.stagger else 0.0
            spy = profiler(args, name, proc, streams)
            cpu0, t0 = cpu_now(groups), time.monotonic()
            results = asyncio.run(
                run_level(url, streams, n, args.tokens, spread, pause, args.prompt_tokens)
            )
            secs = time.monotonic() - t0
            cpu1 = cpu_now(groups)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(30)
            cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
            out[str(streams)] = summarize(results, cpu, secs)
            print(name, streams, brief(out[str(streams)]), flush=True)
        return out
    finally:
        if proc is not None:
            stop(proc)


def profiler(
    args: argparse.Namespace, name: str, proc: subprocess.Popen[bytes] | None, streams: int
) -> subprocess.Popen[bytes] | None:
    """With --profile DIR: py-spy sampling the router over one level (collapsed stacks,
    one file per router and level; py-spy's own CPU is not the router's)."""
    if not args.profile or proc is None:
        return None
    out = Path(args.profile) / f"{name.replace('/', '_')}-{streams}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [args.py_spy, "record", "-p", str(proc.pid), "-r", "250", "-f", "raw", "-o", str(out)]
    spy = subprocess.Popen(argv + ["--nonblocking"], stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the level starts
    return spy


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus else argv


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("added_ms_p50", "added_ms_p99", "router_cpu_ms_per_request")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    levels = report["config"]["levels"]
    for name, cells in report["routers"].items():
        for ax, key in zip(axes, keys, strict=True):
            ys = [cells[str(c)].get(key) for c in levels]
            if all(y is None for y in ys):
                continue
            ax.plot(levels, [float("nan") if y is None else y for y in ys], "o-", label=name)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(key.replace("_", " "))
            ax.legend()
    fig.suptitle("What a router adds to TTFT (client TTFT - upstream TTFT), and its CPU")
    fig.tight_layout()
    png.save(fig, path, dpi=120)


def bench(args: argparse.Namespace) -> int:
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    if args.harness_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.harness_cpus.split(",")})
    me = [sys.executable, os.path.abspath(__file__), "upstream"]
    pace = ["--tokens", str(args.tokens), "--gap-ms", str(args.gap_ms)]
    ports = {"prefill": free_port(), "decode": free_port()}
    procs = {
        role: start(
            pinned(me + ["--role", role, "--port", str(port), "--prefill-ms",
                         str(args.prefill_ms)] + pace, args.harness_cpus),
            logs / f"fake-{role}.log",
        )
        for role, port in ports.items()
    }  # fmt: skip
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    fakes = {f"fake_{role}": p.pid for role, p in procs.items()}
    try:
        for role, url in urls.items():
            wait_http(url + "/health", 30, procs[role])
        report: dict[str, Any] = {
            "config": {**vars(args), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                       "loop": LOOP, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                              time.gmtime())},
            "routers": {},
        }  # fmt: skip
        t0 = time.monotonic()
        for name in args.routers:
            report["routers"][name] = bench_router(name, args, urls, fakes, logs)
        report["config"]["seconds"] = time.monotonic() - t0
        report["config"]["load_avg_end"] = os.getloadavg()
        if "kvpush" in report["routers"] and "vllm-router" in report["routers"]:
            ratios = {}
            for c in args.levels:
                k, v = report["routers"]["kvpush"][str(c)], report["routers"]["vllm-router"][str(c)]
                ratios[str(c)] = {
                    key: (k[key] / v[key] if k[key] is not None and v[key] else None)
                    for key in ("added_ms_p50", "added_ms_p99", "router_cpu_ms_per_request")
                }
            report["kvpush_over_vllm_router"] = ratios
    finally:
        for p in procs.values():
            stop(p)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    print(json.dumps(report.get("kvpush_over_vllm_router", {}), indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    up = sub.add_parser("upstream", help="run one fake upstream (used by the benchmark)")
    up.add_argument("--role", choices=["prefill", "decode"], required=True)
    up.add_argument("--port", type=int, required=True)
    for a in (ap, up):
        a.add_argument("--tokens", type=int, default=16, help="events per decode stream")
        a.add_argument("--gap-ms", type=float, default=10.0, help="pause between events")
        a.add_argument("--prefill-ms", type=float, default=0.0, help="fake prefill's time")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="a prompt of this many token ids (a long prompt's body) instead of a short text",
    )
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    contenders = ["direct", "kvpush", "vllm-router"]
    ap.add_argument("--routers", type=lambda s: s.split(","), default=contenders)
    ap.add_argument("--min-requests", type=int, default=200, help="requests per cell, at least")
    ap.add_argument("--per-stream", type=int, default=10, help="requests per stream and cell")
    two = (os.cpu_count() or 1) >= 2
    ap.add_argument(
        "--router-cpus",
        default="1" if two else None,
        help="taskset CPU list for the router (default 1; '' for none)",
    )
    ap.add_argument(
        "--harness-cpus",
        default="0" if two else None,
        help="CPU list for the client and fake upstreams (default 0; '' for none)",
    )
    ap.add_argument(
        "--no-stagger",
        dest="stagger",
        action="store_false",
        help="start every stream at once, no pause between requests (lockstep)",
    )
    ap.add_argument("--profile", metavar="DIR", help="py-spy each router over each level")
    ap.add_argument("--cprofile", metavar="FILE", help="run kvpush's router under cProfile")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--log-dir", default="/tmp/router-bench")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.cmd == "upstream":
        serve_upstream(args.role, args.port, args.tokens, args.gap_ms / 1e3, args.prefill_ms / 1e3)
        return 0
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())
