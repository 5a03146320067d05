"""The "CPU" section of docs/benchmarks.md, from one `python -m kvpush_bench bench` result."""

from __future__ import annotations

import os
from typing import Any

from kvpush_bench.report import CONFIG_NAMES, configs_of, headline


def _f(v: Any, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def cpu_section(res: dict[str, Any], doc_path: str) -> str:
    h = headline(res)
    m = res.get("machine", {})
    out = [
        "## CPU",
        "",
        f"Latest run: {res.get('started', '?')}, {m.get('cpus', '?')} CPU cores "
        f"(load average {m.get('loadavg_at_start', '?')} at the start; the machine is shared), "
        f"{res.get('elapsed_s', '?')} s. Reproduce with:",
        "",
        "```sh",
        res.get("command", "python -m kvpush_bench bench"),
        "```",
        "",
        "| measure | value | target | |",
        "|---|---|---|---|",
    ]
    for key, t in h["targets"].items():
        state = {True: "met", False: "**missed**", None: "not run"}[t["met"]]
        out.append(f"| `{key}` | {_f(t['value'], 3)} | {t['target']} | {state} |")
    out.append("")
    eng = res.get("engine")
    if eng:
        out += _engine(eng)
    if res.get("transport"):
        out += _transport(res["transport"])
    if res.get("step_cost"):
        out += _steps(res["step_cost"])
    if res.get("idle_cpu"):
        ic = res["idle_cpu"]
        p = ic["percent_of_core"]
        out += [
            "### Idle CPU of a worker",
            "",
            f"A P and a D worker, connected by one push, then idle for {ic['seconds']:g} s: "
            f"P {p['p_worker']:.3f} %, D {p['d_worker']:.3f} % of one core (a process with "
            f"the same imports and no worker: {p['floor']:.3f} %). What is left: the writer's idle "
            "poll (`idle_poll_s`, 100 ms), the heartbeat timer (1 s) and the side channel's "
            "100 ms poll. (vLLM's in-tree connectors keep NIXL's progress thread, which spins.)",
            "",
        ]
    plots = res.get("plots") or []
    if plots:
        base = os.path.dirname(os.path.abspath(doc_path))
        out.append(
            "Plots: "
            + ", ".join(
                f"[{os.path.basename(p)}]({os.path.relpath(os.path.abspath(p), base)})"
                for p in plots
            )
        )
        out.append("")
    return "\n".join(out)


def _engine(eng: dict[str, Any]) -> list[str]:
    o = eng["options"]
    cfgs = configs_of(eng)
    out = [
        "### Engine level (tiny model, one P/D pair at a time)",
        "",
        f"{o['rounds']} rounds; each starts every pair in turn (order rotating), warms it up "
        f"with {o['warmup']} requests, then sends {o['requests']} requests per cell "
        f"(prompt sizes {', '.join(map(str, o['sizes']))} tokens, concurrency "
        f"{', '.join(map(str, o['concurrency']))}, {o['max_tokens']} tokens out, streamed, "
        f"`ignore_eos`, timeout {o['timeout_s']:g} s, failures counted). Times are the "
        "client's, in ms: median (p90).",
        "",
        "- **kvpush**: kvpush's connector on both servers with its defaults (`writer: "
        "inline`, `hand_over: forward`: P pushes from the end of the prefill's forward), "
        "kvpush's router in front, both legs at once.",
        "- **vLLM push**: `NixlPushConnector` on both servers, driven by the benchmark's "
        "client: prefill leg (`max_tokens=1`, `do_remote_decode`) and streamed decode leg "
        "(`do_remote_prefill`, `remote_engine_id`, `remote_request_id`, `remote_host`, "
        "`remote_port`, `tp_size`) at once, same `X-Request-Id`. (Our router's "
        "`--decode-kv-extra` cannot drive it: vLLM 0.32 needs a per-request "
        "`remote_request_id`; without it D's engine dies.)",
        "- **vLLM pull**: `NixlConnector`, driven by the client as vLLM's proxy does: "
        "prefill leg (`max_tokens=1`, `do_remote_decode`), then the streamed decode leg with "
        "the `kv_transfer_params` P returned.",
        "- No proxy process sits in front of the in-tree pairs: they pay one HTTP hop less "
        "than kvpush, whose times include its router.",
        "- vLLM creates its NIXL agent with NIXL's progress thread on (not configurable); "
        "on these 2 cores an idle in-tree pair keeps about one core busy (below), which "
        "slows everything it does. Turning the thread off (a `sitecustomize` shim, tried "
        "once) does not give a fairer baseline: both in-tree connectors then hang (every "
        "request timed out). So the ratios below are against vLLM's connectors as shipped, "
        "on a 2-core machine; they say as much about CPU budget as about the protocol.",
        "",
    ]
    others = cfgs[1:]
    for metric, what in (("ttft", "TTFT"), ("e2e", "End-to-end")):
        out += [
            f"{what}, ms: median (p90); kvpush / other at the median.",
            "",
            "| cell | "
            + " | ".join(CONFIG_NAMES[c] for c in cfgs)
            + " | "
            + " | ".join(f"kvpush / {CONFIG_NAMES[c]}" for c in others)
            + " |",
            "|---|" + "---|" * (len(cfgs) + len(others)),
        ]
        for key, cell in eng["cells"].items():
            vals = [
                f"{_f(cell[c][f'{metric}_ms']['median'])} ({_f(cell[c][f'{metric}_ms']['p90'])})"
                for c in cfgs
            ]
            ratios = [_f(cell.get(f"{metric}_median_ratio_vs_{c}"), 2) for c in others]
            out.append(f"| {key} | " + " | ".join(vals + ratios) + " |")
        out.append("")
    out += _engine_notes(eng, cfgs)
    failed = {c: sum(cell[c]["failed"] for cell in eng["cells"].values()) for c in cfgs}
    total = {c: sum(cell[c]["requests"] for cell in eng["cells"].values()) for c in cfgs}
    out.append(
        "Failed or timed-out requests: "
        + ", ".join(f"{CONFIG_NAMES[c]} {failed[c]}/{total[c]}" for c in cfgs)
        + "."
    )
    idle = eng.get("idle_cpu_percent") or {}
    if idle:
        out += [
            "",
            "Idle CPU of each pair after warm-up (all processes of both servers, "
            "% of one core, median over rounds): "
            + ", ".join(f"{CONFIG_NAMES[c]} {_f(v['median'])}" for c, v in idle.items())
            + ".",
        ]
    starts = [s for s in eng.get("starts", []) if not s.get("ok")]
    if starts:
        out += ["", f"Pairs that did not start: {len(starts)} (see the JSON)."]
    out.append("")
    return out


def _engine_notes(eng: dict[str, Any], cfgs: list[str]) -> list[str]:
    """What the tables say against kvpush, and how noisy they are: derived from the data."""
    behind = [
        f"{key} vs {CONFIG_NAMES[c]} ({_f(cell.get(f'ttft_median_ratio_vs_{c}'), 2)})"
        for key, cell in eng["cells"].items()
        for c in cfgs[1:]
        if (cell.get(f"ttft_median_ratio_vs_{c}") or 0) >= 1
    ]
    samples = eng.get("samples", [])
    burst = []
    for c in cfgs:
        ok = [s for s in samples if s["config"] == c and s["ok"]]
        n = sum(1 for s in ok if s["e2e_ms"] - s["ttft_ms"] < 5)
        burst.append(f"{CONFIG_NAMES[c]} {n}/{len(ok)}")
    return [
        "Cells where kvpush's median TTFT is not below a baseline's: "
        + ("; ".join(behind) if behind else "none")
        + ". Streams that reached the client in one burst (first token within 5 ms of the "
        "end, so TTFT is really end-to-end): " + ", ".join(burst) + ". One request to the "
        "next varies by up to 10x here (other jobs share the 2 cores); every request, with "
        "its round, is in the JSON.",
        "",
    ]


def _transport(tr: dict[str, Any]) -> list[str]:
    out = [
        f"### Transport: {tr['total_mib']} MiB in 64 KiB blocks, P → D, two processes",
        "",
        "P and D each register one buffer with NIXL agents (UCX, progress thread off). "
        "**raw**: one NIXL WRITE with one descriptor per block (as vLLM's connectors post "
        "them), busy-polled to DONE on the calling thread; **raw_runs**: the same with one "
        "descriptor per run contiguous on both sides; **kvpush**: D registers its blocks "
        "(`PUSH_REG`, untimed), P's engine hands the finished blocks to its worker "
        "(`start_step`) and steps every 1 ms (like vLLM's loop while KV is pending), timed "
        "until the worker sees the WRITE DONE (when P's engine saw `finished_sending`, one "
        "step later, is in the JSON). Like raw, the WRITE is posted and checked on the "
        "calling thread. Same buffers and block ids for all, order rotating per round. "
        "kvpush / raw is the median over rounds of "
        "the raw time of the round over the kvpush time next to it (one WRITE to the next "
        "varies by ±20 % on this shared machine). A last, untimed round is checked byte for "
        "byte on D. GiB/s: median (p90).",
        "",
        "| pattern | raw | raw_runs | kvpush | kvpush / raw "
        "| kvpush / raw_runs | kvpush before / in the WRITE call, ms "
        "| descriptors: kvpush = runs (raw, raw_runs) | bytes ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pat, row in tr["patterns"].items():
        d = row["descriptors"]
        g = [row[f"{m}_gib_s"] for m in ("raw", "raw_runs", "kvpush")]
        out.append(
            f"| {pat} | "
            + " | ".join(f"{_f(x['median'], 2)} ({_f(x['p90'], 2)})" for x in g)
            + f" | {_f(row['ratio_vs_raw'], 3)} | {_f(row['ratio_vs_raw_runs'], 3)} "
            f"| {_f(row['kvpush_before_write_ms']['median'], 2)} / "
            f"{_f(row['kvpush_write_call_ms']['median'], 1)} "
            f"| {d.get('kvpush')} = {d.get('runs')} ({d.get('raw')}, {d.get('raw_runs')}) "
            f"| {row['verified']} |"
        )
    worst = min(tr["patterns"], key=lambda p: tr["patterns"][p]["ratio_vs_raw"] or 0)
    row = tr["patterns"][worst]
    out += [
        "",
        f"Where kvpush's time goes ({worst}): {_f(row['kvpush_before_write_ms']['median'], 2)} "
        "ms before the WRITE call (matching, descriptors from the id lists: conversion, "
        "validation, coalescing), then the call itself "
        f"({_f(row['kvpush_write_call_ms']['median'], 1)} ms: NIXL's prepare and post; over "
        "`cma` the copy runs inside the post) against "
        f"{_f(row['raw_ms']['median'], 1)} ms for the whole raw WRITE. kvpush wins where "
        "it merges runs into fewer descriptors (contiguous, fragmented).",
        "",
    ]
    return out


def _steps(sc: dict[str, Any]) -> list[str]:
    out = [
        "### Main-thread cost per engine step",
        "",
        f"The connector's per-step calls in vLLM's order, {sc['steps']} steps 1 ms apart per "
        "point, µs: median (p90); `total` from whole steps timed alone (two clock reads), "
        "the calls from the steps in between. In flight on P: finished prefills waiting for "
        "D; on D: registrations waiting for P's WRITE (P alive, heartbeating). The "
        "scheduler-side calls run in vLLM's engine-core process, the worker-side ones in "
        "the worker process; `total` adds both. The connector runs its defaults (`writer: "
        "inline`: with pushes in flight, `get_finished` also runs the worker's tick, i.e. the "
        "notification poll, WRITE checks and timers). Not counted: vLLM's own wrappers "
        "(`KVPushMeta`, `KVConnectorTransferResults`) and its pickling of the metadata (shown).",
        "",
    ]
    for role, by_n in sc["roles"].items():
        ns = list(by_n)
        calls = list(by_n[ns[0]]["calls_us"])
        out += [
            f"{role.upper()}:",
            "",
            "| call | " + " | ".join(f"{n} in flight" for n in ns) + " |",
            "|---|" + "---|" * len(ns),
        ]
        for call in calls:
            vals = [by_n[n]["calls_us"][call] for n in ns]
            name = f"**{call}**" if call == "total" else call
            if call == "meta_pickle":
                name = "(vLLM's pickling of the metadata, not counted)"
            out.append(
                f"| {name} | "
                + " | ".join(f"{_f(v['median'])} ({_f(v['p90'])})" for v in vals)
                + " |"
            )
        out.append("")
    return out
