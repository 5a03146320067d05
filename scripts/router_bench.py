#!/usr/bin/env python3
"""What a router adds to time-to-first-token: kvpush router and vllm-router side by side.

Both routers front the same two fake upstreams (this file's ``upstream`` command, each its
own process): a prefiller that answers at once (``--prefill-ms``, 0 by default) and a
decoder that streams ``--tokens`` chunks ``--gap-ms`` apart, the first one at once. The
decoder puts its own receive and first-send wall-clock times into its first chunk, so
each request's added latency is the client's TTFT minus the upstream's (same host, same
clock). ``direct`` (the client straight to the fake decoder) is what the harness itself
adds; a router's own cost is its cell minus direct's. Levels of concurrent streams run
closed-loop (each stream sends its next request when the previous one ended); every
request is counted, failures too. CPU per request is the router's processes'
user+system time over the level divided by its requests.

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

import aiohttp
from aiohttp import web

MODEL = "fake-model"


# ---- fake upstreams ------------------------------------------------------------------------


def upstream_app(role: str, tokens: int, gap_s: float, prefill_s: float) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        t_recv = time.time()
        body = await request.json()
        if role == "prefill" or not body.get("stream"):
            if prefill_s:
                await asyncio.sleep(prefill_s)  # the fake prefill's compute time
            params = dict(body.get("kv_transfer_params") or {})
            params.update(do_remote_prefill=True, do_remote_decode=False)
            params.update(remote_host="127.0.0.1", remote_port=1, remote_engine_id="fake")
            choice = {"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}
            return web.json_response(
                {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "created": int(t_recv),
                    "model": MODEL,
                    "choices": [choice],
                    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
                    "kv_transfer_params": params,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            chunk: dict[str, Any] = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": int(t_recv),
                "model": MODEL,
                "choices": [{"index": 0, "text": " a", "finish_reason": None, "logprobs": None}],
            }
            if i == 0:
                chunk["upstream"] = {"recv": t_recv, "first": time.time()}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i + 1 < tokens:
                await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "owned_by": "fake", "max_model_len": 4096}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def serve_upstream(args: argparse.Namespace) -> int:
    app = upstream_app(args.role, args.tokens, args.gap_ms / 1e3, args.prefill_ms / 1e3)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


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


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def cpu_seconds(pgid: int) -> float:
    """User + system time of every live process in group ``pgid`` (a launcher and the
    binary it runs both count), from /proc."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def router_argv(name: str, port: int, p_url: str, d_url: str) -> list[str]:
    if name == "kvpush":
        argv = [sys.executable, "-m", "kvpush.cli", "router", "--port", str(port)]
        return argv + ["--prefill", p_url, "--decode", d_url]
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"
    argv = [exe, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    return argv + ["--prefill", p_url, "--decode", d_url, "--log-level", "warning"]


# ---- client ----------------------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 16, "stream": True}
    start_t = time.time()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"ok": False, "error": f"HTTP {resp.status}"}
            ttft = upstream = None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                if ttft is None:
                    ttft = time.time() - start_t
                    up = json.loads(line[6:]).get("upstream")
                    upstream = None if up is None else up["first"] - up["recv"]
            if ttft is None or upstream is None:
                return {"ok": False, "error": "no first chunk with the upstream's times"}
            return {"ok": True, "ttft": ttft, "added": ttft - upstream}
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


async def run_level(url: str, streams: int, requests: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    left = requests

    async def stream(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            results.append(await one_request(session, url))

    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(stream(session) for _ in range(streams)))
    return results


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(results: list[dict[str, Any]], cpu_s: float) -> dict[str, Any]:
    added = [r["added"] * 1e3 for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    return {
        "requests": len(results),
        "failed": len(errors),
        "errors": sorted(set(errors))[:5],
        "added_ms_p50": pct(added, 0.5),
        "added_ms_p99": pct(added, 0.99),
        "added_ms_mean": statistics.fmean(added) if added else None,
        "cpu_ms_per_request": cpu_s * 1e3 / max(1, len(results)),
    }


def bench_router(name: str, args: argparse.Namespace, p_url: str, d_url: str, logs: Path) -> Any:
    """One contender over every level. ``direct``: the client to the fake decoder with no
    router, the floor this harness (client, upstreams, one machine) measures by itself."""
    proc = None
    url = d_url
    if name != "direct":
        port = free_port()
        proc = start(router_argv(name, port, p_url, d_url), logs / f"router-{name}.log")
        url = f"http://127.0.0.1:{port}"
    try:
        if proc is not None:
            wait_http(url + "/health", 120, proc)
        asyncio.run(run_level(url, 1, 20))  # warm-up, the same for all
        out = {}
        for streams in args.levels:
            cpu0 = cpu_seconds(proc.pid) if proc else 0.0
            results = asyncio.run(run_level(url, streams, max(args.min_requests, 4 * streams)))
            cpu = cpu_seconds(proc.pid) - cpu0 if proc else 0.0
            out[str(streams)] = summarize(results, cpu)
            print(name, streams, json.dumps(out[str(streams)]), flush=True)
        return out
    finally:
        if proc is not None:
            stop(proc)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    levels = report["config"]["levels"]
    for name, cells in report["routers"].items():
        for ax, key in zip(axes, ("added_ms_p50", "added_ms_p99"), strict=True):
            ys = [cells[str(c)][key] for c in levels]
            ax.plot(levels, [float("nan") if y is None else y for y in ys], "o-", label=name)
            ax.set_xscale("log")
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(key.replace("_", " "))
            ax.legend()
    fig.suptitle("TTFT added by the router (client TTFT - upstream TTFT)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def bench(args: argparse.Namespace) -> int:
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, os.path.abspath(__file__), "upstream"]
    pace = ["--tokens", str(args.tokens), "--gap-ms", str(args.gap_ms)]
    p_port, d_port = free_port(), free_port()
    fakes = [
        start(me + ["--role", "prefill", "--port", str(p_port), "--prefill-ms",
                    str(args.prefill_ms)] + pace, logs / "fake-prefill.log"),
        start(me + ["--role", "decode", "--port", str(d_port)] + pace, logs / "fake-decode.log"),
    ]  # fmt: skip
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    try:
        for url in (p_url, d_url):
            wait_http(url + "/health")
        report: dict[str, Any] = {
            "config": {**vars(args), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
            "routers": {},
        }
        for name in args.routers:
            report["routers"][name] = bench_router(name, args, p_url, d_url, logs)
        if "kvpush" in report["routers"] and "vllm-router" in report["routers"]:
            ratios = {}
            for c in args.levels:
                k, v = report["routers"]["kvpush"][str(c)], report["routers"]["vllm-router"][str(c)]
                ratios[str(c)] = {
                    key: (k[key] / v[key] if k[key] is not None and v[key] else None)
                    for key in ("added_ms_p50", "added_ms_p99", "cpu_ms_per_request")
                }
            report["kvpush_over_vllm_router"] = ratios
    finally:
        for f in fakes:
            stop(f)
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
        a.add_argument("--tokens", type=int, default=16, help="chunks per decode stream")
        a.add_argument("--gap-ms", type=float, default=10.0, help="pause between chunks")
        a.add_argument("--prefill-ms", type=float, default=0.0, help="fake prefill's time")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    contenders = ["direct", "kvpush", "vllm-router"]
    ap.add_argument("--routers", type=lambda s: s.split(","), default=contenders)
    ap.add_argument("--min-requests", type=int, default=100, help="requests per level, at least")
    ap.add_argument("--log-dir", default="/tmp/router-bench")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    return serve_upstream(args) if args.cmd == "upstream" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
