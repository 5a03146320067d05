"""`kvpush demo`: vLLM prefill + decode servers with kvpush behind the router.

The engine-free demo (simulated P and D over real NIXL) is ``python -m kvpush_bench demo``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="run the demo: vLLM P/D servers with kvpush behind the router",
        epilog="The engine-free demo over real NIXL is `python -m kvpush_bench demo`.",
    )
    p.add_argument("--requests", type=int, default=8, help="number of requests")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--model", default="", help="model dir (default: the tiny model, made if needed)"
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--check",
        action="store_true",
        help="also run one plain vLLM server and count identical outputs",
    )
    p.add_argument("--workdir", default="", help="where server logs go (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvpush.deploy.servers import sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():
            summary, ok = _vllm(args)
    except KeyboardInterrupt:
        print("kvpush demo: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    return 0 if ok else 1


def _vllm(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from kvpush.deploy.demo import VllmDemoOptions, render, run_vllm_demo

    n = args.requests
    if n < 1 or args.concurrency < 1 or args.max_tokens < 1:
        raise SystemExit("kvpush demo: --requests, --concurrency, --max-tokens must be >= 1")
    opts = VllmDemoOptions(
        requests=n,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        model=args.model,
        check=args.check,
        workdir=args.workdir,
        seed=args.seed,
    )
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    summary = run_vllm_demo(opts, log)
    print(json.dumps(summary) if args.json else render(summary))
    ok = summary["completed"] == summary["requests"]
    if args.check:
        ok = ok and summary["matched"] == summary["requests"]
    return summary, ok
