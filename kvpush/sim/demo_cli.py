"""`kvpush demo`: vLLM prefill + decode servers with kvpush behind the router, or
`--synthetic`: simulated engines over real NIXL."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the demo (vLLM P/D + router, or --synthetic)")
    p.add_argument(
        "--synthetic",
        action="store_true",
        help="engine-free demo: simulated P and D processes over real NIXL",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="number of requests (default 8 with vLLM, 64 synthetic)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    g = p.add_argument_group("vLLM demo")
    g.add_argument(
        "--model", default="", help="model dir (default: the tiny model, made if needed)"
    )
    g.add_argument("--concurrency", type=int, default=4)
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument(
        "--check",
        action="store_true",
        help="also run one plain vLLM server and count identical outputs",
    )
    g.add_argument("--workdir", default="", help="where server logs go (default: a temp dir)")
    s = p.add_argument_group("synthetic demo")
    s.add_argument("--max-blocks", type=int, default=32, help="largest request, in blocks")
    s.add_argument("--layers", type=int, default=4)
    s.add_argument(
        "--block-bytes",
        type=int,
        default=16384,
        help="bytes of one block of one layer's K or V (all KV heads), or MLA page",
    )
    s.add_argument("--p-tp", type=int, default=1, help="prefill tensor-parallel ranks (1, 2, 4)")
    s.add_argument("--d-tp", type=int, default=1, help="decode tensor-parallel ranks (1, 2, 4)")
    s.add_argument("--p-pp", type=int, default=1, help="prefill pipeline stages")
    s.add_argument("--mla", action="store_true", help="MLA caches: pages replicated per rank")
    s.add_argument(
        "--packed",
        action="store_true",
        help="packed MLA rows (all layers of a block in one row); implies --mla",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # SIGTERM behaves like Ctrl-C: the demo's finally-blocks stop every process it started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        summary, ok = _synthetic(args) if args.synthetic else _vllm(args)
    except KeyboardInterrupt:
        print("kvpush demo: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    return 0 if ok else 1


def _synthetic(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from kvpush.sim.demo import DemoOptions, render, run_demo

    n = 64 if args.requests is None else args.requests
    if n < 1 or args.max_blocks < 1 or args.layers < 1 or args.block_bytes < 1:
        raise SystemExit(
            "kvpush demo: --requests, --max-blocks, --layers, --block-bytes must be >= 1"
        )
    if args.p_tp not in (1, 2, 4) or args.d_tp not in (1, 2, 4) or args.p_pp < 1:
        raise SystemExit("kvpush demo: --p-tp and --d-tp must be 1, 2 or 4; --p-pp >= 1")
    if args.layers % args.p_pp:
        raise SystemExit("kvpush demo: --layers must be a multiple of --p-pp")
    heads = max(args.p_tp, args.d_tp)
    if not (args.mla or args.packed) and args.block_bytes % heads:
        raise SystemExit(f"kvpush demo: --block-bytes must divide into {heads} KV heads")
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


def _vllm(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    from kvpush.deploy.demo import VllmDemoOptions, render, run_vllm_demo

    n = 8 if args.requests is None else args.requests
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
