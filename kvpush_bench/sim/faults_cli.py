"""`python -m kvpush_bench faults`: the fault matrix over real NIXL; writes docs/reliability.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpush_bench.sim.fault_cases import CASES
from kvpush_bench.sim.fault_matrix import MatrixOptions, run_matrix
from kvpush_bench.sim.reliability_doc import default_doc, record


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "faults", help="kill P or D at each protocol point and inject faults; check recovery"
    )
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--lease", type=float, default=1.5, help="P's lease in seconds")
    p.add_argument("--watchdog", type=float, default=1.5, help="D's watchdog in seconds")
    p.add_argument("--hold", type=float, default=1.0, help="D's late_write_hold_s in seconds")
    p.add_argument("--slack", type=float, default=2.0, help="seconds added to every bound")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--doc", type=Path, default=None, help="page to write (docs/reliability.md)")
    p.add_argument("--no-doc", action="store_true", help="do not write the page")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    names = [n for n in args.cases.split(",") if n]
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"kvpush_bench faults: unknown cases {sorted(unknown)}; see --list")
    if args.list:
        for c in CASES:
            print(f"{c.name:28} {c.point:40} {c.fault}")
        return 0
    cases = [c for c in CASES if not names or c.name in names]
    opts = MatrixOptions(
        lease_s=args.lease,
        watchdog_s=args.watchdog,
        late_write_hold_s=args.hold,
        slack_s=args.slack,
        log_level=getattr(args, "log_level", "ERROR").upper(),
    )
    quiet = args.json
    result = run_matrix(cases, opts, None if quiet else lambda s: print(s, file=sys.stderr))
    if not args.no_doc:
        record("faults", result, args.doc or default_doc())
    if args.json:
        print(json.dumps(result))
    else:
        for row in result["rows"]:
            got = row.get("outcome", row.get("error"))
            print(f"{'ok ' if row['ok'] else 'BAD'} {row['case']:28} {got}")
        print(f"{result['passed']}/{result['cases']} cases as expected in {result['seconds']} s")
    return 0 if result["passed"] == result["cases"] else 1
