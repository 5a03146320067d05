"""`kvpush demo`: the synthetic (engine-free) demo over real NIXL."""

from __future__ import annotations

import argparse
import json

from kvpush.sim.demo import DemoOptions, render, run_demo


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="push requests between a P and a D process and verify them")
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="engine-free demo: simulated engines over real NIXL",
    )
    p.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    p.add_argument("--max-blocks", type=int, default=32, help="largest request, in blocks")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-bytes", type=int, default=16384, help="bytes per block per K/V region")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.max_blocks < 1 or args.layers < 1 or args.block_bytes < 1:
        raise SystemExit(
            "kvpush demo: --requests, --max-blocks, --layers, --block-bytes must be >= 1"
        )
    opts = DemoOptions(
        requests=args.requests,
        max_blocks=args.max_blocks,
        layers=args.layers,
        block_bytes=args.block_bytes,
        seed=args.seed,
        num_blocks=max(1024, 16 * args.max_blocks),
        log_level=args.log_level.upper(),
    )
    summary = run_demo(opts)
    print(json.dumps(summary) if args.json else render(summary))
    ok = summary["completed"] == summary["requests"] and summary["corrupted"] == 0
    return 0 if ok else 1
