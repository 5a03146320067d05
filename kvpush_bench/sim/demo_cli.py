"""`python -m kvpush_bench demo`: the engine-free demo, simulated P and D engines over real
NIXL. The demo on real vLLM servers is the product's `kvpush demo`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="engine-free demo: simulated P and D processes over real NIXL")
    p.add_argument("--requests", type=int, default=64, help="number of requests")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--max-blocks", type=int, default=32, help="largest request, in blocks")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--block-bytes",
        type=int,
        default=16384,
        help="bytes of one block of one layer's K or V (all KV heads), or MLA page",
    )
    p.add_argument("--p-tp", type=int, default=1, help="prefill tensor-parallel ranks (1, 2, 4)")
    p.add_argument("--d-tp", type=int, default=1, help="decode tensor-parallel ranks (1, 2, 4)")
    p.add_argument("--p-pp", type=int, default=1, help="prefill pipeline stages")
    p.add_argument("--mla", action="store_true", help="MLA caches: pages replicated per rank")
    p.add_argument(
        "--packed",
        action="store_true",
        help="packed MLA rows (all layers of a block in one row); implies --mla",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvpush.deploy.servers import sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():
            summary, ok = _synthetic(args)
    except KeyboardInterrupt:
        msg = "kvpush_bench demo: interrupted; everything it started was stopped"
        print(msg, file=sys.stderr)
        return 130
    return 0 if ok else 1


def _synthetic(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from kvpush_bench.sim.demo import DemoOptions, render, run_demo

    n = args.requests
    if n < 1 or args.max_blocks < 1 or args.layers < 1 or args.block_bytes < 1:
        raise SystemExit(
            "kvpush_bench demo: --requests, --max-blocks, --layers, --block-bytes must be >= 1"
        )
    if args.p_tp not in (1, 2, 4) or args.d_tp not in (1, 2, 4) or args.p_pp < 1:
        raise SystemExit("kvpush_bench demo: --p-tp and --d-tp must be 1, 2 or 4; --p-pp >= 1")
    if args.layers % args.p_pp:
        raise SystemExit("kvpush_bench demo: --layers must be a multiple of --p-pp")
    heads = max(args.p_tp, args.d_tp)
    if not (args.mla or args.packed) and args.block_bytes % heads:
        raise SystemExit(f"kvpush_bench demo: --block-bytes must divide into {heads} KV heads")
    opts = DemoOptions(
        requests=n,
        max_blocks=args.max_blocks,
        layers=args.layers,
        block_bytes=args.block_bytes,
        seed=args.seed,
        num_blocks=max(1024, 16 * args.max_blocks),
        log_level=args.log_level.upper(),
        p_tp=args.p_tp,
        d_tp=args.d_tp,
        p_pp=args.p_pp,
        mla=args.mla or args.packed,
        packed=args.packed,
    )
    summary = run_demo(opts)
    print(json.dumps(summary) if args.json else render(summary))
    return summary, summary["completed"] == summary["requests"] and summary["corrupted"] == 0
