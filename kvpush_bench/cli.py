"""`python -m kvpush_bench`: the harness's commands, one sub-command per module."""

from __future__ import annotations

import argparse
import importlib
import logging

# Each module exposes add_parser(subparsers); the parser it adds sets `func`.
# Imported lazily like kvpush.cli's, so one command's missing extra breaks only it.
_COMMANDS = [
    "kvpush_bench.sim.demo_cli",
    "kvpush_bench.sim.faults_cli",
    "kvpush_bench.sim.soak_cli",
    "kvpush_bench.sim.fuzz_cli",
    "kvpush_bench.bench_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvpush_bench", description=__doc__)
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
