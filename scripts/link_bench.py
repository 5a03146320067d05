"""kvpush against a raw NIXL WRITE over a veth link between two test hosts (needs root).

P and D run as processes on the test hosts of tests/e2e/hosts.py (each in its own
network namespace with a private /dev/shm), UCX restricted to TCP on the link, each with
a raw NIXL agent and a kvpush worker on the same registered buffer of 64 KiB blocks
(kvpush_bench/transport.py's sides). In each round, per case, one raw WRITE (a
descriptor per block, with a notification, P busy-polling it) and one kvpush push
(progressed by P's and D's engine steps, paced as vLLM's with kvpush's connector:
kvpush_bench/transport.py's EngineLoop; D registered first, and P's hand-over reads the
registration, as a vLLM P does after a short prefill; timed from P's engine handing over
the finished blocks) move the same scattered blocks, in rotating order. KV-ready is when
D learned that every byte landed (the raw notification, or kvpush's finished_recving),
from the moment P's prefill handed the blocks over; the delivered rate is the KV's bytes
over that time, P's rate the bytes over P's time to WRITE DONE. Cases: the tiny model's
KV for a 60- and a 450-token prompt (2 layers x 1 or 4 blocks of 64 KiB: 2 / 8 blocks)
and a large synthetic KV (``--large-mib``, scattered). Link rates: full, and tc tbf
limits. Writes the JSON, a plot of the paired ratios, and the rendered part of
docs/benchmarks.md's "Across hosts" section (its subsections stay as they are):

    sudo PYTHONPATH=. .venv/bin/python scripts/link_bench.py --json docs/link/link-bench.json \\
        --plot docs/link/link-bench.png --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shlex
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpush.deploy.servers import free_port  # noqa: E402
from kvpush_bench import png, transport  # noqa: E402
from kvpush_bench.stats import summary  # noqa: E402
from tests.e2e.hosts import Host, HostPair  # noqa: E402

MIB = 1 << 20
KV_MODES = ("kvpush",)  # names as in kvpush_bench/transport.py
MODES = ("raw", *KV_MODES)
# Before P's hand-over: D's registration (a few hundred bytes) reaches P's socket in
# microseconds at full veth speed and well within this at 100 Mbit/s.
REG_FLIGHT_S = 0.002


def in_host(ctx: Any, host: Host, target: Any, args: tuple[Any, ...]) -> Any:
    """Start a spawn-context process inside ``host`` (its namespace, its /dev/shm): the
    spawned interpreter is started through the host's prefix."""
    wrapper = Path(tempfile.mkdtemp(prefix="kvpush-link-")) / "python"
    quoted = shlex.join(host.prefix())  # (the prefix's shell script has quotes of its own)
    wrapper.write_text(f'#!/bin/sh\nexec {quoted} {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    ctx.set_executable(str(wrapper))
    try:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
    finally:
        ctx.set_executable(sys.executable)
    return proc


class Side(transport._Remote):
    def __init__(self, ctx: Any, host: Host, role: str, nblocks: int) -> None:
        self.conn, child = ctx.Pipe()
        self.ports = {m: free_port() for m in KV_MODES}
        self.proc = in_host(
            ctx, host, transport._child, (child, role, self.ports, nblocks, host.link)
        )


def scattered(n: int, nblocks: int, rng: random.Random) -> tuple[list[int], list[int]]:
    return rng.sample(range(nblocks), n), rng.sample(range(nblocks), n)


def one_round(
    p: Side,
    d: Side,
    p_host: str,
    src: list[int],
    dst: list[int],
    seq: int,
    first: int,
    pause: float = 0.0,
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for mode in MODES[first:] + MODES[:first]:
        time.sleep(pause)  # a rate-limited link's token bucket refills: each starts alike
        if mode == "raw":
            d.send("raw_wait", 300.0)
            w = p.call("raw_write", src, dst, False, timeout=300)
            ready = d.result(300)
            ok = bool(w["ok"] and ready["t_ready"])
        else:
            rid = f"{mode}{seq}"
            d.call("kv_register", rid, dst, p.ports[mode], p_host)
            # D's registration crosses the link while P computes; P's hand-over reads it
            # (as in vLLM, where a worker with nothing outstanding reads notifications
            # only when a step hands it work, or every idle_poll_s). One that came late
            # would count in kvpush's time, not hide any of it.
            time.sleep(REG_FLIGHT_S)
            d.send("kv_wait", rid, 300.0)
            w = p.call("kv_push", mode, rid, src, 300.0, timeout=320)
            ready = d.result(320)
            ok = bool(w.get("ok") and ready.get("ok"))
        if not ok:
            raise RuntimeError(f"{mode} WRITE failed: {w} {ready}")
        out[mode] = {"write_s": w["t_done"] - w["t0"], "ready_s": ready["t_ready"] - w["t0"]}
        if "t_write" in w:  # kvpush: until its WRITE call, and the call itself
            out[mode]["to_post_s"] = w["t_write"] - w["t0"]
            out[mode]["post_s"] = w["t_posted"] - w["t_write"]
    return out


def run(rates: list[str], large_mib: int, rounds: int, small_rounds: int, log: Any) -> dict:
    nblocks = max(large_mib * MIB // transport.BLOCK, 64)
    cases = {
        "prompt_60": 2,
        "prompt_450": 8,
        f"large_{large_mib}mib": large_mib * MIB // transport.BLOCK,
    }
    os.environ.update(HostPair.env())  # the children's UCX: TCP on the link only
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {"block_bytes": transport.BLOCK, "rates": {}}
    rng = random.Random(0)
    seq = 0
    with HostPair("kvpb", 79) as hosts:
        p = Side(ctx, hosts.p, "p", nblocks)
        d = Side(ctx, hosts.d, "d", nblocks)
        try:
            pinfo, dinfo = p.result(), d.result()
            p.call("connect", dinfo["raw_md"], dinfo["base"])
            d.call("connect", pinfo["raw_md"], pinfo["base"])
            for rate in rates:
                if rate == "full":
                    hosts.unlimit()
                else:
                    hosts.limit(rate, burst="256kb")
                wire0 = hosts.p.link_counter()
                per: dict[str, Any] = {}
                for name, n in cases.items():
                    k = small_rounds if n < 64 else rounds
                    times: dict[str, list[float]] = {}
                    for r in range(k + 1):  # the first round warms up
                        seq += 1
                        src, dst = scattered(n, nblocks, rng)
                        pause = 0.0 if rate == "full" else 0.1
                        got = one_round(p, d, hosts.p.link, src, dst, seq, r % len(MODES), pause)
                        if r == 0:
                            continue
                        for mode, t in got.items():
                            for key, value in t.items():
                                times.setdefault(f"{mode}_{key}", []).append(value)
                    per[name] = row(n * transport.BLOCK, times)
                    log(f"{rate} {name}: {json.dumps(per[name]['headline'])}")
                per["link_tx_mib"] = round((hosts.p.link_counter() - wire0) / MIB, 1)
                results["rates"][rate] = per
            src, dst = scattered(cases[f"large_{large_mib}mib"], nblocks, rng)
            hosts.unlimit()
            d.call("zero")
            one_round(p, d, hosts.p.link, src, dst, seq + 1, 1)
            results["verified"] = bool(d.call("verify", dst, src, timeout=300))
        finally:
            p.stop()
            d.stop()
    return results


def row(nbytes: int, t: dict[str, list[float]]) -> dict[str, Any]:
    gib = nbytes / (1 << 30)
    out: dict[str, Any] = {"bytes": nbytes, "rounds": len(t["raw_write_s"])}
    head: dict[str, Any] = {}
    for mode in MODES:
        out[f"{mode}_gib_s"] = summary([gib / x for x in t[f"{mode}_write_s"]], 4)
        # What reached D per second after P's prefill ended: the KV over its KV-ready time.
        out[f"{mode}_delivered_gib_s"] = summary([gib / x for x in t[f"{mode}_ready_s"]], 4)
        out[f"{mode}_ready_ms"] = summary([x * 1e3 for x in t[f"{mode}_ready_s"]], 3)
        for key in ("gib_s", "delivered_gib_s", "ready_ms"):
            head[f"{mode}_{key}"] = out[f"{mode}_{key}"]["median"]
    for mode in KV_MODES:
        for part in ("to_post", "post"):  # where kvpush's P time goes before the WRITE
            if t.get(f"{mode}_{part}_s"):
                out[f"{mode}_{part}_ms"] = summary([x * 1e3 for x in t[f"{mode}_{part}_s"]], 3)
        # Each round's raw time over kvpush's in the same round (robust to drift).
        for what, key in (("write", "ratio"), ("ready", "ready_ratio")):
            raw, kv = t[f"raw_{what}_s"], t[f"{mode}_{what}_s"]
            paired = [r / k for r, k in zip(raw, kv, strict=True) if k]
            out[f"{mode}_{key}_vs_raw"] = summary(paired, 3)
            head[f"{mode}_{key}"] = out[f"{mode}_{key}_vs_raw"]["median"]
    out["headline"] = head
    return out


HEADING = "## Across hosts (veth link)"
TARGET = 0.9  # issue 22: kvpush / raw on the same link
# (label, headline key of its paired ratio)
MEASURES = (("delivered (KV-ready)", "kvpush_ready_ratio"), ("P's WRITE time", "kvpush_ratio"))


def cells(res: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(rate, case, headline) of every cell, in run order."""
    return [
        (rate, case, r["headline"])
        for rate, per in res["rates"].items()
        for case, r in per.items()
        if isinstance(r, dict)
    ]


def delivered(h: dict[str, Any], mode: str, nbytes: int) -> float:
    """Delivered GiB/s; from the KV-ready median for a result saved before it was kept."""
    if f"{mode}_delivered_gib_s" in h:
        return float(h[f"{mode}_delivered_gib_s"])
    return nbytes / (1 << 30) / (h[f"{mode}_ready_ms"] / 1e3)


def verdict(res: dict[str, Any], key: str) -> str:
    """Every cell under the target, named (or that none is), with the lowest ratio."""
    got = [(h[key], f"{rate} {case}") for rate, case, h in cells(res)]
    low = min(got)
    under = [f"{name} {x:.2f}" for x, name in got if x < TARGET]
    where = "; under it: " + ", ".join(under) if under else "; none under it"
    return f"lowest {low[0]:.2f} ({low[1]}){where}"


def section(res: dict[str, Any], json_path: str = "", plot_path: str = "") -> str:
    """The benchmarks page's rendered part for one result (docs/benchmarks.md); the
    page's subsections after it are kept as they are."""
    sizes = {case: r["bytes"] for per in res["rates"].values() for case, r in per.items()
             if isinstance(r, dict)}  # fmt: skip
    files = ", ".join(
        f"{what}: `{p}`" for what, p in (("JSON", json_path), ("plot", plot_path)) if p
    )
    out = [
        HEADING,
        "",
        "This part is rendered by `scripts/link_bench.py --doc` from one run; the subsections",
        "after it are written by hand: other runs of the same script.",
        "",
        f"Run: {res.get('started', '?')}, {res.get('cpus', '?')} CPU cores (load average"
        f" {res.get('loadavg', '?')} at the start), {res.get('seconds')} s;"
        f" `{res.get('command', 'scripts/link_bench.py')}`." + (f" {files}." if files else ""),
        "",
        "P and D are processes on two test hosts (`tests/e2e/hosts.py`: network namespaces,",
        "a private `/dev/shm` each, one veth pair between them), UCX restricted to TCP on that",
        "veth (`UCX_NET_DEVICES`; `UCX_TLS=tcp`, or `tcp,cuda_copy` where a GPU is present, as",
        "NIXL requires there: it moves no byte between the hosts' CPU memory), each with a raw",
        "NIXL agent and a kvpush worker on one buffer of 64 KiB blocks, in CPU memory. Per",
        "round and case the same scattered blocks move by",
        "a raw NIXL WRITE (a descriptor per block, D's ids known to P beforehand, P busy-polling",
        "its end, D polling notifications every 50 us) and by kvpush (D registers, the",
        "registration crosses the link for 2 ms, P's hand-over reads it and posts; P's and D's",
        "engines step as vLLM's do while a push is pending: back to back for 5 ms, then every",
        "0.5 ms), order rotating. Every time starts when P's engine hands the finished blocks",
        "over (P's prefill ended):",
        "",
        "- **Delivered GiB/s:** the KV's bytes over the time until D knew they had all landed",
        "  (KV-ready: raw's notification, kvpush's finished_recving). What D's first token",
        "  waits for.",
        "- **P's GiB/s:** the same bytes over the time until P saw its WRITE done. P learns of",
        "  the end after D with both (raw busy-polls, kvpush at its engine's step pace); it",
        "  sets only when P can free its blocks.",
        "- **Ratios:** the median over rounds of raw's time over kvpush's in the same round",
        "  (> 1: kvpush faster). Other figures are medians.",
        "",
        "| link | case | KiB | delivered GiB/s raw / kvpush | kvpush / raw | P's GiB/s raw /"
        " kvpush | kvpush / raw | KV-ready ms raw / kvpush |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rate, case, h in cells(res):
        n = sizes[case]
        out.append(
            f"| {rate} | {case} | {n >> 10} | {delivered(h, 'raw', n):.3f} /"
            f" {delivered(h, 'kvpush', n):.3f} | {h['kvpush_ready_ratio']:.2f} |"
            f" {h['raw_gib_s']:.3f} / {h['kvpush_gib_s']:.3f} | {h['kvpush_ratio']:.2f} |"
            f" {h['raw_ready_ms']:.2f} / {h['kvpush_ready_ms']:.2f} |"
        )
    out += [
        "",
        f"Target kvpush / raw >= {TARGET} on the same link.",
        "",
        *(f"- {label}: {verdict(res, key)}." for label, key in MEASURES),
        f"- Last large WRITE checked byte for byte on D: {res.get('verified')}.",
        "",
        "Not covered: KV in GPU memory (CPU buffers here), a real NIC or switch (a veth pair",
        "on one machine), UCX transports other than TCP, vLLM's own work in each step (the",
        "steps are paced as vLLM's but empty), and concurrent pushes (one at a time).",
        "",
    ]
    return "\n".join(out) + "\n"


def plot(res: dict[str, Any], path: str) -> None:
    """Both paired ratios of every cell, with the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    got = cells(res)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(got)), 4.2))
    width = 0.38
    for k, (label, key) in enumerate(MEASURES):
        xs = [i + (k - 0.5) * width for i in range(len(got))]
        ax.bar(xs, [h[key] for _, _, h in got], width, label=f"kvpush / raw, {label}")
    ax.axhline(TARGET, color="k", linestyle="--", linewidth=1, label=f"target {TARGET}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(got)))
    ax.set_xticklabels([f"{rate}\n{case}" for rate, case, _ in got], fontsize=8)
    ax.set_ylabel("median paired ratio (> 1: kvpush faster)")
    ax.set_title(f"kvpush vs raw NIXL WRITE over veth, {res.get('cpus', '?')} CPU cores,"
                 f" {res.get('started', '')}", fontsize=9)  # fmt: skip
    top = max(h[key] for _, _, h in got for _, key in MEASURES)
    ax.set_ylim(0, max(1.3, top * 1.2))  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    png.save(fig, path, dpi=110)


def update_doc(path: Path, text: str) -> None:
    """Replace the rendered part of this section (up to its first subsection or the next
    section), or put the section before CPU."""
    doc = path.read_text()
    if HEADING in doc:
        start = doc.index(HEADING)
        ends = [doc.find(m, start + len(HEADING)) for m in ("\n### ", "\n## ")]
        end = min((e for e in ends if e >= 0), default=-1)
        doc = doc[:start] + text + (doc[end + 1 :] if end >= 0 else "")
    elif "\n## CPU" in doc:
        at = doc.index("\n## CPU") + 1
        doc = doc[:at] + text + "\n" + doc[at:]
    else:
        doc += "\n" + text
    path.write_text(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="full,1gbit,100mbit", help="'full' or tc rates")
    ap.add_argument("--large-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the large case")
    ap.add_argument("--small-rounds", type=int, default=30, help="rounds of the prompt cases")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--doc", default="", help="rewrite this page's section (docs/benchmarks.md)")
    ap.add_argument("--plot", default="", help="draw the paired ratios here (PNG)")
    ap.add_argument("--from-json", default="", help="no run: render this saved result")
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        started = time.time()
        load = [round(x, 2) for x in os.getloadavg()]
        res = run(args.rates.split(","), args.large_mib, args.rounds, args.small_rounds, print)
        # The machine's size: small pushes compare differently on 2 busy cores and 16 idle ones.
        res.update(seconds=round(time.time() - started, 1), loadavg=load, cpus=os.cpu_count())
        res["started"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
        res["command"] = "scripts/link_bench.py " + " ".join(sys.argv[1:])
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    if args.plot:
        plot(res, args.plot)
    text = section(res, args.json or args.from_json, args.plot)
    if args.doc:
        update_doc(Path(args.doc), text)
    print(text)
    return 0 if res.get("verified") else 1


if __name__ == "__main__":
    sys.exit(main())
