"""Engine level: client TTFT and end-to-end latency through one P/D pair at a time.

On 2 CPU cores only one pair can run at once (idle in-tree servers still burn CPU), so
the run goes in rounds: each round starts every configuration's pair in turn (rotating
the order from round to round), warms it up, sends every (prompt size, concurrency)
cell, and stops it. Every round uses its own prompts, the same for every configuration.
A request that fails or times out is counted, never retried.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpush_bench.idle_cpu import tree_cpu_seconds
from kvpush_bench.pairs import CONFIGS, LABELS, Sample, make_pair
from kvpush_bench.stats import ratio, summary

Log = Callable[[str], None]
VOCAB_LO, VOCAB_HI = 20, 1000  # plain tokens of the tiny model (specials are above 1020)


@dataclass
class EngineOptions:
    model: str
    workdir: str
    configs: tuple[str, ...] = CONFIGS
    sizes: tuple[int, ...] = (60, 200, 450)
    concurrency: tuple[int, ...] = (1, 4)
    rounds: int = 3
    requests: int = 8  # per cell and round; at concurrency c rounded up to a multiple of c
    warmup: int = 3
    max_tokens: int = 16
    timeout_s: float = 30.0
    idle_s: float = 5.0  # CPU of the idle pair measured over this long (0: skip)
    seed: int = 0


@dataclass
class Record:
    config: str
    round: int
    size: int
    concurrency: int
    ok: bool
    ttft_ms: float
    e2e_ms: float
    error: str = ""


@dataclass
class EngineRun:
    records: list[Record] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)  # per activation
    idle_cpu: dict[str, list[float]] = field(default_factory=dict)  # config -> % of a core


def prompts_for(round_no: int, size: int, n: int, seed: int, cell: int = 0) -> list[list[int]]:
    """``n`` distinct prompts of ``size`` tokens for one round and ``cell`` (the same for
    every config). Servers run with vLLM's prefix caching on: no prompt may repeat one
    the same server saw, or it would skip its prefill."""
    rng = random.Random(f"{seed}-{round_no}-{size}-{cell}")
    return [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(size)] for _ in range(n)]


def run_cell(
    send: Callable[[list[int]], Sample], prompts: list[list[int]], concurrency: int
) -> list[Sample]:
    if concurrency == 1:
        return [send(p) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(send, prompts))


def run_engine(opts: EngineOptions, log: Log = print) -> EngineRun:
    run = EngineRun()
    Path(opts.workdir).mkdir(parents=True, exist_ok=True)
    for r in range(opts.rounds):
        k = r % len(opts.configs)
        order = opts.configs[k:] + opts.configs[:k]
        for cfg in order:
            _activation(opts, run, r, cfg, log)
    return run


def _activation(opts: EngineOptions, run: EngineRun, r: int, cfg: str, log: Log) -> None:
    tag = f"[round {r + 1}/{opts.rounds}] {cfg:6}"
    log_dir = os.path.join(opts.workdir, f"r{r + 1}-{cfg}")
    pair = make_pair(cfg, opts.model, log_dir)
    log(f"{tag} starting {LABELS[cfg]} (logs in {log_dir}) ...")
    t0 = time.monotonic()
    try:
        pair.start()
    except Exception as e:  # a pair that does not come up is recorded, the run goes on
        log(f"{tag} FAILED to start: {str(e).splitlines()[0][:200]}")
        run.starts.append({"config": cfg, "round": r, "ok": False, "error": str(e)[-2000:]})
        return
    started = time.monotonic() - t0
    run.starts.append({"config": cfg, "round": r, "ok": True, "start_s": round(started, 1)})
    try:

        def send(p: list[int]) -> Sample:
            return pair.send(p, opts.max_tokens, opts.timeout_s)

        warm = [send(p) for p in prompts_for(-1 - r, 200, opts.warmup, opts.seed)]
        log(
            f"{tag} healthy after {started:.0f}s; warm-up {sum(s.ok for s in warm)}/{len(warm)} "
            f"ok in {time.monotonic() - t0 - started:.0f}s"
        )
        if opts.idle_s > 0:
            pct = _idle_cpu(pair.pids(), opts.idle_s)
            run.idle_cpu.setdefault(cfg, []).append(pct)
            log(f"{tag} idle CPU of the pair over {opts.idle_s:g}s: {pct:.1f} % of a core")
            send(prompts_for(-1 - r, 200, 1, opts.seed + 1)[0])  # back from idle, untimed
        for size in opts.sizes:
            for conc in opts.concurrency:
                n = -(-opts.requests // conc) * conc
                got = run_cell(send, prompts_for(r, size, n, opts.seed, conc), conc)
                for s in got:
                    run.records.append(
                        Record(
                            cfg,
                            r,
                            size,
                            conc,
                            s.ok,
                            round(s.ttft_s * 1e3, 2),
                            round(s.total_s * 1e3, 2),
                            s.error[:300],
                        )
                    )
                ok = [s.ttft_s * 1e3 for s in got if s.ok]
                med = summary(ok)["median"]
                log(
                    f"{tag} {size:>3} tok c={conc}: {len(ok)}/{len(got)} ok, "
                    f"TTFT median {med if med is not None else '-'} ms"
                )
    finally:
        pair.stop()


def _idle_cpu(pids: list[int], seconds: float) -> float:
    time.sleep(2.0)  # let the warm-up's tail (responses, frees, stats logging) settle
    before = tree_cpu_seconds(pids)
    t0 = time.monotonic()
    time.sleep(seconds)
    return 100.0 * (tree_cpu_seconds(pids) - before) / (time.monotonic() - t0)


def aggregate(run: EngineRun, opts: EngineOptions) -> dict[str, Any]:
    """Per config and cell: TTFT and end-to-end summaries; ratios kvpush/push, kvpush/pull."""
    cells: dict[str, Any] = {}
    for size in opts.sizes:
        for conc in opts.concurrency:
            key = f"{size}tok_c{conc}"
            cell: dict[str, Any] = {"size": size, "concurrency": conc}
            for cfg in opts.configs:
                recs = [
                    x
                    for x in run.records
                    if x.config == cfg and x.size == size and x.concurrency == conc
                ]
                ok = [x for x in recs if x.ok]
                cell[cfg] = {
                    "requests": len(recs),
                    "failed": len(recs) - len(ok),
                    "ttft_ms": summary([x.ttft_ms for x in ok], 2),
                    "e2e_ms": summary([x.e2e_ms for x in ok], 2),
                }
            for other in [c for c in opts.configs if c != "kvpush"]:
                for m in ("ttft_ms", "e2e_ms"):
                    for stat in ("median", "p90"):
                        a = cell.get("kvpush", {}).get(m, {}).get(stat)
                        b = cell.get(other, {}).get(m, {}).get(stat)
                        cell[f"{m.removesuffix('_ms')}_{stat}_ratio_vs_{other}"] = ratio(a, b)
            cells[key] = cell
    return {
        "options": {k: v for k, v in asdict(opts).items() if k not in ("model", "workdir")},
        "cells": cells,
        "starts": run.starts,
        "idle_cpu_percent": {k: summary(v, 2) for k, v in run.idle_cpu.items()},
        "failures": [asdict(x) for x in run.records if not x.ok][:50],
        "samples": [asdict(x) for x in run.records],
    }
