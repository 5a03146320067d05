"""Layer-wise push against whole-request push across a slowed link (issue 23), on CPU.

P and D run on the test hosts of tests/e2e/hosts.py (network namespaces joined by one
veth, private /dev/shm, UCX on TCP over the veth), the veth limited by ``tc tbf``. Two
prefillers share P's host and core: one pushes every prompt layer by layer
(``layerwise_min_tokens: 1``), the other whole at the end of its forward (the default);
one decoder; one router per prefiller in the root namespace. The model is the tiny
model's ``layers`` shape (12 layers, KV of 12 KiB per token), random weights.

Each round sends every prompt size once through each router, one request at a time,
the two modes in alternating order, streamed with ``max_tokens`` 2. The clock is the
client's time to the second token: D's output whichever way the first token came (the
router sends P's first token to the client for these greedy requests, so the TTFT no
longer waits for the push; it is recorded too). Per request it also reads, from P's
/metrics: the whole push's transfer time (``kvpush_push_seconds``: from the blocks handed
over at the end of the forward to the WRITE done) and the prefill time (vLLM's
``request_prefill_time``). Share hidden = (after whole - after layer-wise) / transfer
time of the whole push, where "after" is a request's second-token time less its own
prefill time on P (medians per size; the shared machine's prefill times vary by 2x
between requests); ``hidden_share_ttft`` is the same from the second-token medians alone
(its name kept from when the first token was D's).

    sudo PYTHONPATH=. .venv/bin/python scripts/layer_bench.py --rate 200mbit \\
        --json docs/layers/layer-bench.json --plot docs/layers/layer-bench.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpush.deploy.client import Reply, request  # noqa: E402
from kvpush.deploy.servers import (  # noqa: E402
    RouterProc,
    ServerSpec,
    VllmServer,
    free_port,
    kvpush_config,
    metric,
    wait_healthy,
)
from kvpush.tiny_model import make_tiny_model  # noqa: E402
from kvpush_bench import png  # noqa: E402
from tests.e2e.hosts import Host, HostPair  # noqa: E402

MODES = ("layer", "whole")
PUSH = "vllm:kvpush_push_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
# One measurement's processes: the prefiller per mode, the decoder, the router per mode.
Setup = tuple[dict[str, VllmServer], VllmServer, dict[str, RouterProc]]


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 20 for i in range(n)]


def server(name: str, model: str, role: str, host: Host, hosts: HostPair, work: str,
           core: int, max_len: int, spec: dict[str, Any] | None = None,
           **extra: Any) -> VllmServer:  # fmt: skip
    """A server on ``host``; ``spec``: further ServerSpec fields (the GPU variant's),
    ``extra``: kvpush connector options."""
    config = kvpush_config(role, name, free_port(), side_channel_host=host.link, **extra)
    # Prefix caching off: each round sends both modes the same prompt (their outputs are
    # compared), and a decoder that cached the first mode's KV would take none from the second.
    fields: dict[str, Any] = {"env": hosts.env(), "max_num_batched_tokens": max_len,
                              "max_num_seqs": 2, "extra_args": ["--no-enable-prefix-caching"],
                              **(spec or {})}  # fmt: skip
    return VllmServer(ServerSpec(
        name, model, kv_config=config, core=core, log_dir=work, host=host.front,
        prefix=host.prefix(), max_model_len=max_len, **fields,
    ))  # fmt: skip


def start(model: str, hosts: HostPair, work: str, max_len: int,
          spec: dict[str, Any] | None = None, **extra: Any) -> Setup:  # fmt: skip
    """Both prefillers (P's host, core 0), the decoder (D's host, core 1) and one router per
    prefiller, started at once (not yet healthy): the processes of one measurement."""
    p = {
        "layer": server("p-layer", model, "kv_producer", hosts.p, hosts, work, 0, max_len,
                        spec, layerwise_min_tokens=1, **extra),
        "whole": server("p-whole", model, "kv_producer", hosts.p, hosts, work, 0, max_len,
                        spec, **extra),
    }  # fmt: skip
    d = server("decode", model, "kv_consumer", hosts.d, hosts, work, 1, max_len, spec, **extra)
    routers = {
        m: RouterProc(p[m].url, d.url, f"{hosts.p.link}:{side(p[m])}", work,
                      extra=["--timeout", "120"])
        for m in MODES
    }  # fmt: skip
    return p, d, routers


def side(s: VllmServer) -> int:
    assert s.spec.kv_config is not None
    return int(s.spec.kv_config["kv_connector_extra_config"]["side_channel_port"])


def hist(url: str, name: str) -> tuple[float, float]:
    return metric(url, name + "_sum"), metric(url, name + "_count")


def one(router: RouterProc, p: VllmServer, model: str, prompt: list[int],
        timeout_s: float = 120) -> dict[str, Any]:  # fmt: skip
    """One request; its TTFT, its second token's time and P's push and prefill seconds."""
    push0, prefill0 = hist(p.url, PUSH), hist(p.url, PREFILL)
    reply: Reply = request(router.url, model, prompt, None, 2, True, timeout_s)
    out: dict[str, Any] = {"ok": reply.ok, "ttft_s": reply.ttft_s, "second_s": reply.second_s,
                           "error": reply.error, "tokens": reply.token_ids}  # fmt: skip
    # P's histograms arrive with its stats, a moment after the request: wait for them.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        push, prefill = hist(p.url, PUSH), hist(p.url, PREFILL)
        if push[1] > push0[1] and prefill[1] > prefill0[1]:
            out["push_s"] = (push[0] - push0[0]) / (push[1] - push0[1])
            out["prefill_s"] = (prefill[0] - prefill0[0]) / (prefill[1] - prefill0[1])
            break
        time.sleep(0.05)
    return out


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(cells: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        got = {m: [c for c in cells if c["size"] == n and c["mode"] == m] for m in MODES}
        ok = {m: [c for c in got[m] if c["ok"]] for m in MODES}
        ttft = {m: med([c["ttft_s"] for c in ok[m]]) for m in MODES}
        second = {m: med([c["second_s"] for c in ok[m]]) for m in MODES}
        transfer = med([c["push_s"] for c in ok["whole"] if "push_s" in c])
        prefill = med([c["prefill_s"] for c in ok["whole"] if "prefill_s" in c])
        # The second token's time less the request's own prefill on P: what the push (and
        # D) add after the prefill, robust to the prefill's noise on this shared machine.
        after = {
            m: med([c["second_s"] - c["prefill_s"] for c in ok[m] if "prefill_s" in c])
            for m in MODES
        }
        hidden = hidden_raw = None
        if after["layer"] is not None and after["whole"] is not None and transfer:
            hidden = (after["whole"] - after["layer"]) / transfer
        if second["layer"] is not None and second["whole"] is not None and transfer:
            hidden_raw = (second["whole"] - second["layer"]) / transfer
        rows.append({
            "size": n, "ttft_layer_s": ttft["layer"], "ttft_whole_s": ttft["whole"],
            "second_layer_s": second["layer"], "second_whole_s": second["whole"],
            "after_prefill_layer_s": after["layer"], "after_prefill_whole_s": after["whole"],
            "transfer_whole_s": transfer, "prefill_s": prefill, "hidden_share": hidden,
            "hidden_share_ttft": hidden_raw,
            "failed_layer": len(got["layer"]) - len(ok["layer"]),
            "failed_whole": len(got["whole"]) - len(ok["whole"]),
            "token_mismatches": sum(
                1 for a in ok["layer"] for b in ok["whole"]
                if a["round"] == b["round"] and a["tokens"] != b["tokens"]
            ),
        })  # fmt: skip
    return rows


def plot(rows: list[dict[str, Any]], cells: list[dict[str, Any]], path: str, rate: str,
         device: str = "CPU") -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = [r["size"] for r in rows]
    for mode, color in (("whole", "tab:red"), ("layer", "tab:blue")):
        xs = [c["size"] for c in cells if c["mode"] == mode and c["ok"]]
        ys = [c["second_s"] * 1e3 for c in cells if c["mode"] == mode and c["ok"]]
        ax.scatter(xs, ys, s=12, color=color, alpha=0.5)
        name = "layer-wise" if mode == "layer" else "whole-request"
        medians = [(r[f"second_{mode}_s"] or float("nan")) * 1e3 for r in rows]
        ax.plot(sizes, medians, color=color, label=f"second token (D's output), {name} push")
    ax.plot(sizes, [(r["prefill_s"] or 0) * 1e3 for r in rows], "k--", label="prefill (P)")
    ax.plot(sizes, [(r["transfer_whole_s"] or 0) * 1e3 for r in rows], "k:",
            label="whole push's transfer (P)")  # fmt: skip
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms (medians; dots: every request)")
    ax.set_title(f"Layer-wise push, {device}, P-D link {rate} (tc tbf, veth)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.save(fig, path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="200mbit", help="tc rate of the link ('none': no limit)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024, 2048, 3072])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="docs/layers/layer-bench.json")
    ap.add_argument("--plot", default="docs/layers/layer-bench.png")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="kvpush-layers-")
    model = make_tiny_model(work + "/model", shape="layers")
    max_len = max(args.sizes) + 64
    cells: list[dict[str, Any]] = []
    with HostPair(prefix="kvl", net=78) as hosts:
        if args.rate != "none":
            hosts.limit(args.rate, burst="256kb", latency="2s")
        p, d, routers = start(model, hosts, work, max_len)
        procs = [*routers.values(), d, *p.values()]
        try:
            wait_healthy(procs, timeout=600)
            for n in args.sizes:  # warm-up, not recorded
                for m in MODES:
                    one(routers[m], p[m], model, ids(n, 999))
            started = time.time()
            for r in range(args.rounds):
                for n in args.sizes:
                    for m in MODES if r % 2 == 0 else MODES[::-1]:
                        cell = one(routers[m], p[m], model, ids(n, n))
                        cells.append({"round": r, "size": n, "mode": m, **cell})
                        print(json.dumps({k: v for k, v in cells[-1].items() if k != "tokens"}),
                              flush=True)  # fmt: skip
        finally:
            for proc in procs:
                proc.stop()
    rows = summarize(cells, args.sizes)
    out = {"rate": args.rate, "rounds": args.rounds, "sizes": args.sizes, "started": started,
           "model": "tiny_model shape 'layers' (12 layers, 12 KiB KV per token, float32)",
           "summary": rows, "cells": cells}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    for row in rows:
        print(json.dumps(row))
    try:
        plot(rows, cells, args.plot, args.rate)
    except ImportError as e:
        print(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
