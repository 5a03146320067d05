"""`python -m kvpush_bench`: the harness's commands, one sub-command per module."""

from __future__ import annotations

import argparse

from kvpush import cli

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
    return cli.build_parser("python -m kvpush_bench", __doc__, _COMMANDS)


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser(), argv)
