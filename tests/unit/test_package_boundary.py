"""The product package `kvpush` stays apart from the harness `kvpush_bench` and stays small.

kvpush_bench imports kvpush, never the other way round: an installed kvpush must run
without the harness. Checked on the source (ast), so a lazy import inside a function or a
module path handed to importlib counts too.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ROOT / "kvpush"
MAX_LINES = 400
_MODULE_PATH = re.compile(r"kvpush_bench(\.\w+)*")


def _product_files() -> list[Path]:
    files = sorted(PRODUCT.rglob("*.py"))
    assert len(files) > 20, f"found only {len(files)} files under {PRODUCT}"
    return files


def _harness_refs(path: Path) -> list[str]:
    """Imports of kvpush_bench in one file, and strings that are a kvpush_bench module path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if _MODULE_PATH.fullmatch(node.value) else []
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] == "kvpush_bench"]
    return found


def test_scan_sees_an_import_of_the_harness(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "import json\n"
        "def f():\n"
        "    from kvpush_bench.sim import engine\n"
        "    import kvpush_bench\n"
        "    return __import__('importlib').import_module('kvpush_bench.cli')\n"
        "DOC = 'run `python -m kvpush_bench demo`'\n"
    )
    assert _harness_refs(src) == [
        "line 3: kvpush_bench.sim",
        "line 4: kvpush_bench",
        "line 5: kvpush_bench.cli",
    ]


def test_product_imports_nothing_from_the_harness() -> None:
    bad = {str(p.relative_to(ROOT)): refs for p in _product_files() if (refs := _harness_refs(p))}
    assert not bad, f"kvpush must not import kvpush_bench: {bad}"


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_product_file_over_the_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): _lines(p) for p in _product_files()}
    over = {k: n for k, n in sizes.items() if n > MAX_LINES}
    assert not over, f"product files over {MAX_LINES} lines: {over}"


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_harness_commands_left_the_product_command() -> None:
    from kvpush import cli as product
    from kvpush_bench import cli as harness

    assert _commands(product.build_parser()) == {"demo", "tiny-model", "router"}
    assert _commands(harness.build_parser()) == {"demo", "faults", "soak", "fuzz", "bench"}
    with pytest.raises(SystemExit):  # the engine-free demo is the harness's now
        product.build_parser().parse_args(["demo", "--synthetic"])
    args = harness.build_parser().parse_args(["demo", "--p-tp", "2", "--mla"])
    assert (args.requests, args.p_tp, args.mla) == (64, 2, True)
