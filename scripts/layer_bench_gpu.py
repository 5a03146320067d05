"""Layer-wise push against whole-request push across a rate-limited link, on one GPU (issue 23).

scripts/layer_bench.py's measurement (its servers, requests, summary and plot, imported
from it) with vLLM on CUDA: P's two prefillers (one layer-wise, one whole) and D's decoder
share the GPU, each in its test host (tests/e2e/hosts.py: network namespaces, private
/dev/shm; through pyroute2 where there is no ``ip``/``tc``). kvpush's same-host CUDA IPC
copy is off (``peer_copy: off``) and UCX gets no CUDA IPC, so every KV byte crosses the
veth, limited by a token bucket at each ``--rates`` value in turn (one server start for
all). Model: tiny_model's ``gqa`` shape by default (16 layers, hidden 4096, 2 KV heads,
16 KiB of KV per token, the compute per KV byte of a large GQA model), random bf16 weights,
built on the GPU in a subprocess (the bench process never touches CUDA).

Order: build the model, start all servers at once, probe (one request per mode at the
smallest size: a broken UCX setting fails here, with the servers' log tails), one warm-up
request per size and mode, then rounds (every rate, size and mode once, modes
alternating), until ``--rounds``, until the next round would pass ``--budget-s`` (the JSON
says so) or, with ``--stop-on-failure``, at the first failed request. Every request is recorded,
failed ones too, with the bytes P sent on the link for it. Writes under ``--out``:
layer-bench-gpu.json, layer-bench-gpu-RATE.png, logs/.

On the GPU machine, the bundle unpacked to /tmp/site (../shared/tools/gpu-vllm/README.md),
the pyroute2 wheel unpacked to /tmp/pr2site, from the repository root:

    python3 -m zipfile -e pyroute2-0.9.7-py3-none-any.whl /tmp/pr2site &&
    export PYTHONPATH=/tmp/site:$PWD:/tmp/pr2site TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \\
        HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 &&
    python3 scripts/layer_bench_gpu.py --out $OUT/layers --rates 2gbit 8gbit --rounds 5 \\
        --budget-s 330

A smoke run on CPU (as root; the tiny ``layers`` model):

    PYTHONPATH=. .venv/bin/python scripts/layer_bench_gpu.py --device cpu --shape layers \\
        --sizes 256 512 --rounds 1 --rates 200mbit --out /tmp/lbg
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layer_bench import MODES, Setup, ids, med, one, plot, start, summarize  # noqa: E402

from kvpush.deploy.servers import VllmServer, wait_healthy  # noqa: E402
from tests.e2e.hosts import HostPair  # noqa: E402

# No cuda_ipc: the GPU is shared, so it would bypass the link. Not UCX_RMA_PPLN_ENABLE=y
# (UCX's pipelined PUT of VRAM through host fragments): with it, a decoder's connections
# broke for good after a few 128-512 MiB pushes in every run that had them, and without
# it the same pushes took as long (docs/benchmarks.md). UCX_PROTO_INFO: the servers' logs
# name the protocol UCX chose for each transfer.
GPU_UCX = "UCX_TLS=tcp,cuda_copy UCX_PROTO_INFO=y"
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_env(text: str) -> dict[str, str]:
    """``"A=1 B=x,y"`` -> {"A": "1", "B": "x,y"}."""
    out = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not (sep and key):
            raise ValueError(f"{item!r}: expected NAME=VALUE")
        out[key] = value
    return out


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate ("200mbit", "8gbit")."""
    m = re.fullmatch(r"(\d+)([a-z]+)", rate)
    if not m or m.group(2) not in RATE_UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of {list(RATE_UNITS)}")
    return int(m.group(1)) * RATE_UNITS[m.group(2)] / 8


def set_rate(hosts: HostPair, rate: str) -> None:
    if rate == "none":
        hosts.unlimit()
        return
    # tbf passes at most one bucket per timer tick: at Gbit/s, 256 kB would cap the rate
    # below the one asked; 4 ms of the rate is enough at any tick rate up to 250 Hz.
    burst_kb = max(256, int(rate_bytes(rate) * 0.004 / 1024))
    hosts.limit(rate, burst=f"{burst_kb}kb", latency="1s")


def ensure_model(args: argparse.Namespace) -> tuple[str, float]:
    """The model directory, built in a subprocess (CUDA stays out of this process)."""
    t = time.monotonic()
    model = args.model or f"/tmp/kvpush-models/{args.shape}"
    cmd = [sys.executable, "-m", "kvpush.cli", "tiny-model", model, "--shape", args.shape]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else None
    subprocess.run(cmd, check=True, env=env)
    return model, time.monotonic() - t


def kv_per_token(c: dict[str, Any], dtype_bytes: int) -> int:
    """Bytes of KV per token of a model config: layers x (K, V) x KV heads x head dim x
    dtype bytes."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return int(c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * dtype_bytes)


def server_spec(args: argparse.Namespace, hosts: HostPair, ucx: str) -> dict[str, Any]:
    env = {**hosts.env(), **parse_env(ucx)}  # UCX_TLS here replaces the CPU's "tcp"
    if args.device == "cpu":
        return {"device": "cpu", "env": env}
    return {
        "device": "cuda", "env": env, "cuda_graphs": True,
        "gpu_memory_utilization": args.gpu_util,
        "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
        "max_num_batched_tokens": args.chunk,
    }  # fmt: skip


def stop_all(procs: list[Any]) -> None:
    for proc in procs:  # all told at once: GPU servers take seconds each to exit
        proc.send(signal.SIGTERM)
    for proc in procs:
        proc.stop()


def tails(procs: list[Any], lines: int = 60) -> dict[str, str]:
    """Each server's last log lines without its access lines: the bench's /metrics and
    /health polls would fill a plain tail and hide a failure's warnings and errors."""
    out = {}
    for proc in procs:
        kept = [ln for ln in proc.tail(20000).splitlines() if '"GET /' not in ln]
        # The exit status says whether a server died (an engine crash) or answers errors.
        out[f"{proc.name}-{proc.popen.pid} rc={proc.popen.poll()}"] = "\n".join(kept[-lines:])
    return out


def bring_up(args: argparse.Namespace, model: str, hosts: HostPair, out: dict[str, Any],
             deadline: float) -> tuple[Setup, list[Any]] | None:  # fmt: skip
    """The servers, once a request per mode went through (the probe), or None."""
    t = time.monotonic()
    logs = Path(args.out, "logs")
    spec = server_spec(args, hosts, args.ucx_env)
    setup = start(model, hosts, str(logs), args.max_len, spec, peer_copy="off")
    p, d, routers = setup
    procs = [*routers.values(), d, *p.values()]
    probe: dict[str, Any] = {"ucx_env": args.ucx_env, "server_env": spec["env"],
                             "logs": str(logs)}  # fmt: skip
    out["probes"].append(probe)
    try:
        wait_healthy(procs, timeout=max(60.0, deadline - time.monotonic()))
        probe["start_s"] = time.monotonic() - t
        set_rate(hosts, args.rates[0])
        for m in MODES:
            # A short timeout: a UCX setting that hangs must not eat the budget.
            probe[m] = one(routers[m], p[m], model, ids(args.sizes[0], 999), 30)
            print(f"probe {m}: ok={probe[m]['ok']} ttft={probe[m]['ttft_s']} "
                  f"error={probe[m]['error']}", flush=True)  # fmt: skip
        probe["ok"] = all(probe[m]["ok"] for m in MODES)
    except Exception as e:
        probe["ok"] = False
        probe["error"] = repr(e)[-2000:]
    if probe["ok"]:
        out["ucx_env"] = args.ucx_env
        return setup, procs
    probe["tails"] = tails(procs)
    for name, text in probe["tails"].items():
        print(f"---- {name} (probe failed) ----\n{text}", flush=True)
    stop_all(procs)
    return None


def measure(args: argparse.Namespace, model: str, hosts: HostPair, setup: Setup,
            out: dict[str, Any], t0: float) -> None:  # fmt: skip
    """Warm-up, then the rounds, into out["cells"]; stops before a round that would end
    past the budget."""
    p, _, routers = setup
    t = time.monotonic()
    for n in args.sizes:  # warm-up, not recorded
        for m in MODES:
            one(routers[m], p[m], model, ids(n, 999))
    out["warmup_s"] = time.monotonic() - t
    last = 0.0  # the last round's seconds: the next one's estimate
    for r in range(args.rounds):
        if time.monotonic() - t0 + last > args.budget_s:
            out["cut"] = f"after {r} of {args.rounds} rounds: --budget-s {args.budget_s}"
            print(out["cut"], flush=True)
            break
        t = time.monotonic()
        for rate in args.rates:
            set_rate(hosts, rate)
            for n in args.sizes:
                for m in MODES if r % 2 == 0 else MODES[::-1]:
                    wire = hosts.p.link_counter()
                    cell = one(routers[m], p[m], model, ids(n, n))
                    cell["link_bytes"] = hosts.p.link_counter() - wire
                    out["cells"].append({"round": r, "rate": rate, "size": n, "mode": m, **cell})
                    shown = {k: v for k, v in out["cells"][-1].items() if k != "tokens"}
                    print(json.dumps(shown), flush=True)
                    if args.stop_on_failure and not cell["ok"]:
                        out["cut"] = f"round {r}: stopped at the first failed request"
                        print(out["cut"], flush=True)
                        return
        last = time.monotonic() - t
        out["rounds_done"] = r + 1


def gpu_shares(row: dict[str, Any], cells: list[dict[str, Any]]) -> None:
    """On a GPU a whole push is handed over as its forward is launched and its WRITE waits
    on an event behind it, so P's push clock (``transfer_whole_s``) includes most of the
    forward: the transfer after the prefill is that less the prefill, per request. The
    shares hidden are also given against it."""
    whole = [c for c in cells if c["size"] == row["size"] and c["mode"] == "whole" and c["ok"]]
    t = med([c["push_s"] - c["prefill_s"] for c in whole if "push_s" in c])
    row["transfer_after_prefill_s"] = t
    a, b = row["after_prefill_whole_s"], row["after_prefill_layer_s"]
    x, y = row["second_whole_s"], row["second_layer_s"]
    row["hidden_share_gpu"] = (a - b) / t if t and None not in (a, b) else None
    row["hidden_share_ttft_gpu"] = (x - y) / t if t and None not in (x, y) else None


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Summaries per rate (layer_bench's), the JSON and one plot per rate."""
    out["summary"] = []
    for rate in args.rates:
        cells = [c for c in out["cells"] if c["rate"] == rate]
        rows = summarize(cells, args.sizes)
        for row in rows:
            sent = [c["link_bytes"] for c in cells if c["size"] == row["size"] and c["ok"]]
            row["rate"] = rate
            row["link_bytes_median"] = sorted(sent)[len(sent) // 2] if sent else None
            if args.device == "cuda":
                gpu_shares(row, cells)
            print(json.dumps(row), flush=True)
        out["summary"] += rows
        try:
            png = Path(args.out, f"layer-bench-gpu-{rate}.png")
            plot(rows, cells, str(png), rate, device=args.device.upper())
        except Exception as e:  # no matplotlib, or no successful request to draw
            print(f"no plot for {rate}: {e!r}")
    Path(args.out, "layer-bench-gpu.json").write_text(json.dumps(out, indent=1))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the JSON, plots and logs")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", default="gqa", help="tiny_model shape (when --model is built)")
    ap.add_argument("--model", default="", help="model directory (built there if absent)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--rates", nargs="+", default=["2gbit", "8gbit"],
                    help="tc rates of the link, each in turn ('none': no limit)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="wall seconds from start after which no round starts")  # fmt: skip
    ap.add_argument("--max-len", type=int, default=0, help="0: the largest size + 64")
    ap.add_argument("--chunk", type=int, default=0,
                    help="max_num_batched_tokens (GPU); 0: --max-len (one chunk)")  # fmt: skip
    ap.add_argument("--gpu-util", type=float, default=0.2, help="per server (three share)")
    ap.add_argument("--kv-cache-gib", type=float, default=4.0, help="per server (GPU)")
    ap.add_argument("--ucx-env", default=None, help=f"NAME=VALUE ...; GPU default {GPU_UCX!r}")
    ap.add_argument("--probe", action="store_true", help="stop after the probe")
    ap.add_argument("--stop-on-failure", action="store_true",
                    help="end the run at the first failed request (a broken link makes each "
                         "later one wait for its timeout)")  # fmt: skip
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    if args.ucx_env is None:
        args.ucx_env = GPU_UCX if gpu else ""
    for rate in args.rates:
        if rate != "none":
            rate_bytes(rate)  # a bad rate fails now, not after the servers started
    parse_env(args.ucx_env)
    args.max_len = args.max_len or max(args.sizes) + 64
    args.chunk = args.chunk or args.max_len
    return args


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = parse(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "device": args.device, "rates": args.rates, "sizes": args.sizes,
        "rounds": args.rounds, "rounds_done": 0, "cut": None, "budget_s": args.budget_s,
        "max_len": args.max_len, "chunk": args.chunk, "gpu_util": args.gpu_util,
        "kv_cache_gib": args.kv_cache_gib, "ucx_env": None, "probes": [], "cells": [],
        "started": time.time(), "error": None,
    }  # fmt: skip
    procs: list[VllmServer] = []
    try:
        model, out["model_build_s"] = ensure_model(args)
        config = json.loads(Path(model, "config.json").read_text())
        kv = kv_per_token(config, 4 if args.device == "cpu" else 2)  # float32 on CPU
        out["model"] = {"dir": model, "shape": args.shape, "config": config,
                        "kv_bytes_per_token": kv}  # fmt: skip
        with HostPair(prefix="kvg", net=82) as hosts:
            out["net"] = type(hosts.net).__name__
            got = bring_up(args, model, hosts, out, t0 + args.budget_s)
            if got is None:
                out["error"] = "every probe failed (see probes)"
            else:
                setup, procs = got
                try:
                    if not args.probe:
                        measure(args, model, hosts, setup, out, t0)
                finally:
                    if any(not c["ok"] for c in out["cells"]):
                        out["tails"] = tails(procs)
                    stop_all(procs)
    except BaseException as e:  # Ctrl-C or a crash: what was measured is still written
        out["error"] = repr(e)[-2000:]
        raise
    finally:
        out["wall_s"] = time.monotonic() - t0
        report(args, out)
        print(f"wrote {Path(args.out, 'layer-bench-gpu.json')}; error={out['error']}", flush=True)
    return 0 if out["error"] is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
