"""`python -m kvpush_bench soak`: many requests over real NIXL with injected faults."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpush_bench.sim.reliability_doc import default_doc, record
from kvpush_bench.sim.soak import FAULTS, SoakOptions, run_soak


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("soak", help="push many requests with injected faults; count the damage")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--fault-rate", type=float, default=0.05, help="fraction of faulted requests")
    p.add_argument("--window", type=int, default=32, help="requests in flight at once")
    p.add_argument("--max-blocks", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--faults", default="", help=f"comma-separated subset of: {', '.join(sorted(FAULTS))}"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--doc", type=Path, default=None, help="page to write (docs/reliability.md)")
    p.add_argument("--no-doc", action="store_true", help="do not write the page")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.window < 1 or args.max_blocks < 1:
        raise SystemExit("kvpush_bench soak: --requests, --window and --max-blocks must be >= 1")
    if not 0.0 <= args.fault_rate <= 1.0:
        raise SystemExit("kvpush_bench soak: --fault-rate must be within [0, 1]")
    menu = [f for f in args.faults.split(",") if f] or sorted(FAULTS)
    unknown = set(menu) - set(FAULTS)
    if unknown:
        raise SystemExit(f"kvpush_bench soak: unknown faults {sorted(unknown)}")
    opts = SoakOptions(
        requests=args.requests,
        fault_rate=args.fault_rate,
        window=args.window,
        max_blocks=args.max_blocks,
        seed=args.seed,
        faults=menu,
        log_level=getattr(args, "log_level", "ERROR").upper(),
    )
    s = run_soak(opts)
    if not args.no_doc:
        record("soak", s, args.doc or default_doc())
    if args.json:
        print(json.dumps(s))
    else:
        print(
            f"kvpush_bench soak: {s['requests']} requests, {s['faulted_requests']} faulted\n"
            f"  completed {s['completed']}  failed {s['failed']}  released {s['released']}\n"
            f"  hung {s['hung']}  leaked blocks {s['leaked_blocks']}  crashes {s['crashes']}"
            f"  corrupted {s['corrupted']}\n"
            f"  completion rate {s['completion_rate']} (unfaulted {s['clean_completion_rate']})"
            f", {s['requests_per_s']} requests/s"
        )
    bad = s["hung"] or s["leaked_blocks"] or s["crashes"] or s["corrupted"]
    return 1 if bad else 0
