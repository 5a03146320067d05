"""`python -m kvpush_bench fuzz`: hostile notifications into live workers' notification path."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpush_bench.sim.fuzz import FuzzOptions, run_fuzz
from kvpush_bench.sim.reliability_doc import default_doc, record


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("fuzz", help="feed hostile notifications to live workers")
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=500, help="inputs per delivery")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--doc", type=Path, default=None, help="page to write (docs/reliability.md)")
    p.add_argument("--no-doc", action="store_true", help="do not write the page")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.inputs < 1 or args.batch < 1:
        raise SystemExit("kvpush_bench fuzz: --inputs and --batch must be >= 1")
    step = max(args.batch, args.inputs // 10)

    def progress(p: dict[str, Any]) -> None:
        if not args.json and p["inputs"] % step < args.batch:
            print(f"  {p['inputs']} inputs, {p['writes_caused']} writes", file=sys.stderr)

    s = run_fuzz(FuzzOptions(inputs=args.inputs, seed=args.seed, batch=args.batch), progress)
    if not args.no_doc:
        record("fuzz", s, args.doc or default_doc())
    if args.json:
        print(json.dumps(s))
    else:
        print(
            f"kvpush_bench fuzz: {s['inputs']} inputs, {s['rejected']} rejected by the decoder, "
            f"{s['ignored']} dropped by handlers\n"
            f"  crashes {s['crashes']}  writes caused {s['writes_caused']}  "
            f"({s['inputs_per_s']} inputs/s)"
        )
    return 1 if s["crashes"] or s["writes_caused"] or not s["writers_alive"] else 0
