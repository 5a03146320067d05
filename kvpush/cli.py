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


def build_parser(
    prog: str = "kvpush", description: str | None = __doc__, commands: list[str] = _COMMANDS
) -> argparse.ArgumentParser:
    """The parser of a command made of ``commands`` (modules with ``add_parser``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands:
        importlib.import_module(name).add_parser(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv``, set up logging and run the chosen sub-command."""
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
