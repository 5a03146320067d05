"""`kvpush router`: run the router in front of one prefill and one decode server."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parse_host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); argparse turns the ValueError into a usage error."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _json_object(value: str) -> dict[str, Any]:
    obj = json.loads(value)
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="OpenAI-compatible router for one prefill/decode pair")
    p.add_argument("--prefill", required=True, help="base URL of the prefill server")
    p.add_argument("--decode", required=True, help="base URL of the decode server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--prefill-side-channel",
        type=parse_host_port,
        metavar="HOST:PORT",
        help="the prefiller's handshake side channel, sent to D as remote_host/remote_port",
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvpush --help` does not need aiohttp.
    from aiohttp import web

    from kvpush.router.app import RouterConfig, make_app

    config = RouterConfig(
        prefill_url=args.prefill.rstrip("/"),
        decode_url=args.decode.rstrip("/"),
        timeout=args.timeout,
        prefill_side_channel=args.prefill_side_channel,
        decode_kv_extra=args.decode_kv_extra,
    )
    # handler_cancellation: a client that hangs up cancels its handler, whose cleanup then
    # cancels both legs, so P and D abort the request instead of finishing it for nobody.
    web.run_app(
        make_app(config),
        host=args.host,
        port=args.port,
        access_log=None,
        handler_cancellation=True,
    )
    return 0
