"""`python -m kvpush_bench bench`: kvpush against vLLM's own NIXL connectors, and the cost
of kvpush itself.

Parts (``--parts``, all by default): ``engine`` (TTFT / end-to-end through a vLLM P/D
pair: kvpush, in-tree push, in-tree pull, interleaved in rounds), ``transport`` (kvpush
WRITE vs raw NIXL WRITE), ``step`` (main-thread cost per engine step), ``idle`` (CPU of
an idle worker). Progress goes to stderr, the summary table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from typing import Any

PARTS = ("engine", "transport", "step", "idle")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="benchmarks against vLLM's NIXL connectors (issue 5)")
    p.add_argument("--quick", action="store_true", help="a short run of every part")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--json", metavar="FILE", help="write all results to this JSON file")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here (default: next to --json)")
    p.add_argument("--doc", metavar="FILE", help="rewrite the CPU section of this markdown file")
    p.add_argument(
        "--render",
        metavar="JSON",
        help="run nothing: print, plot and --doc the results of an earlier --json file",
    )
    e = p.add_argument_group("engine level")
    e.add_argument(
        "--model", default="", help="model dir (default: the tiny model, made if needed)"
    )
    e.add_argument(
        "--configs", default="kvpush,push,pull", help="pairs to compare: kvpush, push, pull"
    )
    e.add_argument("--rounds", type=int, help="rounds over all pairs (default 3, quick 1)")
    e.add_argument("--requests", type=int, help="requests per cell and round (default 8, quick 4)")
    e.add_argument("--sizes", default="60,200,450", help="prompt sizes in tokens")
    e.add_argument("--concurrency", default="1,4")
    e.add_argument("--max-tokens", type=int, default=16)
    e.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    e.add_argument("--workdir", default="", help="server logs (default: a temp dir)")
    t = p.add_argument_group("transport / step cost / idle CPU")
    t.add_argument("--transport-mib", type=int, default=256)
    t.add_argument("--transport-rounds", type=int, help="default 30, quick 5")
    t.add_argument(
        "--steps", type=int, help="timed engine steps per point (default 3000, quick 300)"
    )
    t.add_argument("--idle-seconds", type=float, help="default 10, quick 3")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, bench_argv=None)


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from kvpush.deploy.servers import sigterm_as_interrupt

    with sigterm_as_interrupt():  # every server the engine part started is stopped
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.render:
        with open(args.render) as f:
            return _output(args, json.load(f))
    parts = [x for x in args.parts.split(",") if x]
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"kvpush_bench bench: unknown part(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    from kvpush_bench.pairs import LABELS

    bad = set(args.configs.split(",")) - set(LABELS)
    if "engine" in parts and bad:
        print(f"kvpush_bench bench: unknown config(s) {', '.join(sorted(bad))}", file=sys.stderr)
        return 2
    q = args.quick
    argv = args.bench_argv
    if argv is None:  # as `python -m kvpush_bench bench ...`
        argv = sys.argv[1:]
        argv = argv[argv.index("bench") + 1 :] if "bench" in argv else argv
    res: dict[str, Any] = {
        "command": "python -m kvpush_bench bench " + " ".join(shlex.quote(a) for a in argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": _machine(),
    }
    t0 = time.monotonic()
    try:
        if "step" in parts:
            from kvpush_bench.step_cost import run_step_cost

            res["step_cost"] = run_step_cost(steps=args.steps or (300 if q else 3000), log=_log)
        if "idle" in parts:
            from kvpush_bench.idle_cpu import run_idle_cpu

            res["idle_cpu"] = run_idle_cpu(args.idle_seconds or (3.0 if q else 10.0), log=_log)
        if "transport" in parts:
            from kvpush_bench.transport import run_transport

            rounds = args.transport_rounds or (5 if q else 30)
            res["transport"] = run_transport(args.transport_mib, rounds, args.seed, log=_log)
        if "engine" in parts:
            res["engine"] = _engine(args, q)
    except KeyboardInterrupt:
        msg = "kvpush_bench bench: interrupted; every server it started was stopped"
        print(msg, file=sys.stderr)
        return 130
    res["elapsed_s"] = round(time.monotonic() - t0, 1)
    return _output(args, res)


def _save(path: str, res: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def _output(args: argparse.Namespace, res: dict[str, Any]) -> int:
    """Summary table on stdout, then the PNGs, the JSON file and the doc section."""
    from kvpush_bench import report

    head = report.headline(res)
    res = {**head, **{k: v for k, v in res.items() if k not in head}}
    save = bool(args.json) and args.json != args.render
    if save:  # first: a run of tens of minutes must not be lost to a rendering error
        _save(args.json, res)
    print(report.table(res))
    plots_dir = args.plots or (os.path.dirname(os.path.abspath(args.json)) if args.json else "")
    if plots_dir:
        res["plots"] = report.plot(res, plots_dir)
        _log("plots: " + ", ".join(res["plots"]))
    if save:
        _save(args.json, res)
        _log(f"results: {args.json}")
    if args.doc:
        from kvpush_bench.doc import cpu_section

        report.update_doc(args.doc, cpu_section(res, args.doc))
        _log(f"doc: {args.doc} (CPU section)")
    return 0


def _engine(args: argparse.Namespace, quick: bool) -> dict[str, Any]:
    from kvpush.deploy.demo import default_model_dir, ensure_model
    from kvpush_bench.engine import EngineOptions, aggregate, run_engine

    model = ensure_model(args.model or default_model_dir())
    opts = EngineOptions(
        model=model,
        workdir=args.workdir or tempfile.mkdtemp(prefix="kvpush-bench-"),
        configs=tuple(x for x in args.configs.split(",") if x),
        sizes=_ints(args.sizes),
        concurrency=_ints(args.concurrency),
        rounds=args.rounds or (1 if quick else 3),
        requests=args.requests or (4 if quick else 8),
        warmup=2 if quick else 3,
        max_tokens=args.max_tokens,
        timeout_s=args.timeout,
        idle_s=0.0 if quick else 5.0,
        seed=args.seed,
    )
    return aggregate(run_engine(opts, log=_log), opts)


def _machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpush_bench.bench_cli ...``: ``python -m kvpush_bench bench ...``."""
    parser = argparse.ArgumentParser(prog="python -m kvpush_bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(["bench", *argv])
    args.bench_argv = argv
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
