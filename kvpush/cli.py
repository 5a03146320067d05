"""The `kvpush` console command: one sub-command per module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Each module exposes add_parser(subparsers); the parser it adds sets `func`.
# Modules are imported lazily so that a missing optional extra (vLLM) only
# breaks the command that needs it.
# The harness (synthetic demo, faults, soak, fuzz, bench) is `python -m kvpush_bench`.
_COMMANDS = [
    "kvpush.deploy.demo_cli",
    "kvpush.tiny_model",
    "kvpush.router.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _COMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
