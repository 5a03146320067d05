"""A short soak over real NIXL: faults in a fraction of requests, nothing hangs or leaks."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvpush_bench.sim import soak_cli
from kvpush_bench.sim.soak import FAULTS

pytestmark = pytest.mark.integration


def test_short_soak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    soak_cli.add_parser(parser.add_subparsers())
    doc = tmp_path / "reliability.md"
    argv = ["soak", "--requests", "300", "--fault-rate", "0.25", "--seed", "3", "--json"]
    args = parser.parse_args([*argv, "--doc", str(doc)])
    rc = args.func(args)
    s = json.loads(capsys.readouterr().out)
    assert s["hung"] == 0 and s["leaked_blocks"] == 0 and s["crashes"] == 0, s
    assert s["corrupted"] == 0 and rc == 0, s
    # Every request is accounted for exactly once.
    assert s["completed"] + s["failed"] + s["released"] == s["requests"] == 300, s
    # Faults really fired, of most kinds, and the unfaulted traffic still went through.
    assert s["faulted_requests"] >= 40 and len(s["faults"]) >= len(FAULTS) - 3, s
    assert sum(s["faults_fired"].values()) >= 30, s
    assert s["completed"] >= 200 and 0 < s["completion_rate"] < 1, s
    page = doc.read_text()
    assert "## Soak" in page and f"| 300 | {s['completed']} | {s['failed']} |" in page
