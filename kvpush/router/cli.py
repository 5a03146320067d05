"""`kvpush router`: run the router in front of pools of prefill and decode servers."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from kvpush.router.pool import InstanceSpec, Policy
from kvpush.router.pool import parse_host_port as _parse_host_port

if TYPE_CHECKING:
    from kvpush.router.config import RouterConfig


def parse_host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); argparse turns the ValueError into a usage error."""
    return _parse_host_port(value)


def _json_object(value: str) -> dict[str, Any]:
    obj = json.loads(value)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router",
        help="OpenAI-compatible router over prefill and decode pools",
        epilog="Environment: KVPUSH_PARAMS_SECRET seals every leg's kv_transfer_params; set "
        "the same on P and D, which then act only on sealed ones (docs/operating.md, "
        '"Trust set-up").',
    )
    p.add_argument(
        "--prefill", action="append", default=[], help="base URL of a prefill server (repeatable)"
    )
    p.add_argument(
        "--decode", action="append", default=[], help="base URL of a decode server (repeatable)"
    )
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--prefill-side-channel",
        type=parse_host_port,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a prefiller's handshake side channel, sent to D as remote_host/remote_port; "
        "repeatable, the n-th for the n-th --prefill",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help='JSON pools {"prefill": [{"url", "side_channel", "drain"}], "decode": [...]}, '
        "re-read when it changes and on SIGHUP (added to the instances given by flags)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds per leg; for streams, the longest allowed gap between chunks",
    )
    p.add_argument(
        "--decode-kv-extra",
        type=_json_object,
        default={},
        metavar="JSON",
        help="extra kv_transfer_params for the decode leg (e.g. for the in-tree baseline)",
    )
    p.add_argument("--retries", type=int, default=1, help="tries on another pair (default 1)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S")
    p.add_argument("--health-timeout", type=float, default=5.0, metavar="S")
    p.add_argument("--health-fails", type=int, default=2, metavar="N")
    p.add_argument("--health-passes", type=int, default=2, metavar="N")
    p.add_argument("--scrape-interval", type=float, default=1.0, metavar="S")
    p.add_argument("--breaker-failures", type=int, default=3, metavar="N")
    p.add_argument("--breaker-cooldown", type=float, default=5.0, metavar="S")
    p.add_argument(
        "--affinity-chars",
        type=int,
        default=256,
        help="prompt characters hashed for prefill affinity (0: load only)",
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("KVPUSH_ROUTER_ADMIN_TOKEN") or None,
        help="bearer token /admin/* and the detailed /health require (default "
        "$KVPUSH_ROUTER_ADMIN_TOKEN); without one the admin endpoints are off",
    )
    p.add_argument(
        "--admin-loopback-without-token",
        action="store_true",
        help="without --admin-token, open /admin/* and the detailed /health to clients "
        "on this host (loopback) with no token: any local user or program can then "
        "change the pools (a browser's page is refused: foreign Origin or Host)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=1024,
        metavar="N",
        help="client requests served at once; beyond, 503 with Retry-After (default 1024)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=64 * 1024 * 1024,
        metavar="N",
        help="largest request body; a larger one gets 413 (default 64 MiB)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds a client has to send its request body; a slower one gets 408 and "
        "its connection closed (default 30)",
    )
    p.set_defaults(func=run)


def instances(args: argparse.Namespace) -> tuple[InstanceSpec, ...]:
    """The instances given by flags; ValueError if the side channels do not pair up."""
    sides = args.prefill_side_channel
    if sides and len(sides) != len(args.prefill):
        raise ValueError(
            f"{len(sides)} --prefill-side-channel for {len(args.prefill)} --prefill: "
            "give one per prefiller, in the same order"
        )
    out = [
        InstanceSpec("prefill", url.rstrip("/"), sides[n] if sides else None)
        for n, url in enumerate(args.prefill)
    ]
    out += [InstanceSpec("decode", url.rstrip("/")) for url in args.decode]
    if not args.config and not (args.prefill and args.decode):
        raise ValueError("give --prefill and --decode (each at least once), or --config")
    return tuple(out)


def config(args: argparse.Namespace) -> RouterConfig:
    """The router's settings from its flags; ValueError for flags that do not fit."""
    from kvpush.core import seal
    from kvpush.router.config import RouterConfig

    policy = Policy(
        breaker_failures=args.breaker_failures,
        breaker_cooldown=args.breaker_cooldown,
        affinity_chars=args.affinity_chars,
    )
    return RouterConfig(
        timeout=args.timeout,
        decode_kv_extra=args.decode_kv_extra,
        instances=instances(args),
        config_path=args.config,
        policy=policy,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_fails=args.health_fails,
        health_passes=args.health_passes,
        scrape_interval=args.scrape_interval,
        retries=args.retries,
        admin_token=args.admin_token,
        admin_loopback_open=args.admin_loopback_without_token,
        max_concurrent=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        params_secret=seal.from_env(),
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvpush --help` does not need aiohttp.
    from aiohttp import web

    from kvpush.router.app import make_app

    try:
        cfg = config(args)
    except ValueError as exc:
        raise SystemExit(f"kvpush router: {exc}") from None
    # handler_cancellation: a client that hangs up cancels its handler, whose cleanup then
    # cancels both legs, so P and D abort the request instead of finishing it for nobody.
    web.run_app(
        make_app(cfg),
        host=args.host,
        port=args.port,
        access_log=None,
        handler_cancellation=True,
        # Many clients connecting at once (a benchmark's start) overflowed aiohttp's
        # default 128, and each dropped SYN costs a client a 1 s retransmit.
        backlog=1024,
    )
    return 0
