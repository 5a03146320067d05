"""`python -m kvpush_bench bench` in short: judged on completing and on the shape of what it writes.

The transport, step-cost and idle-CPU parts run for real (NIXL agents in child
processes), at toy sizes. The engine part needs vLLM pairs (minutes each on 2 cores),
so its runner, aggregation, table and plots run here over a stub pair instead.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from kvpush_bench import bench_cli, engine, report
from kvpush_bench.pairs import Pair, Sample

pytestmark = pytest.mark.integration


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    bench_cli.add_parser(sub)
    args = parser.parse_args(["bench", *argv])
    return int(args.func(args))


def test_bench_quick_transport_step_idle(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## GPU (H200)\n\nkept as it is\n")
    rc = _bench(
        [
            "--quick",
            "--parts", "transport,step,idle",
            "--transport-mib", "16",
            "--transport-rounds", "2",
            "--steps", "60",
            "--idle-seconds", "1",
            "--json", str(out),
            "--doc", str(doc),
        ]
    )  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("write_ratio_vs_raw", "step_us_idle", "step_us_1000", "idle_cpu_percent"):
        assert isinstance(res[key], float), key
    assert res["ttft_ratio_vs_push"] is None  # the engine part did not run
    tr = res["transport"]
    assert tr["descriptors_equal_runs"]
    assert all(row["verified"] for row in tr["patterns"].values())
    assert {Path(p).name for p in res["plots"]} == {"cpu-transport.png", "cpu-step-cost.png"}
    text = doc.read_text()
    assert "## GPU (H200)\n\nkept as it is" in text and "## CPU" in text


class StubPair(Pair):
    """Answers at once with made-up times: a little faster for kvpush."""

    def __init__(self, name: str, model: str, log_dir: str) -> None:
        super().__init__(model, log_dir)
        self.name = name
        self.rng = random.Random(name)

    def _launch(self) -> list:  # type: ignore[type-arg]
        return []

    def send(self, prompt: list[int], max_tokens: int, timeout: float) -> Sample:
        base = {"kvpush": 0.05, "push": 0.08, "pull": 0.12}[self.name]
        ttft = base * (1 + len(prompt) / 500) * self.rng.uniform(0.9, 1.1)
        return Sample(True, ttft, ttft + 0.01 * max_tokens, len(prompt))


def test_engine_runner_over_stub_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "make_pair", lambda n, m, d: StubPair(n, m, d))
    opts = engine.EngineOptions(
        model="stub", workdir=str(tmp_path), rounds=2, requests=4, warmup=1, idle_s=0.1
    )
    logs: list[str] = []
    agg = engine.aggregate(engine.run_engine(opts, logs.append), opts)
    assert any("round 2/2" in line for line in logs)
    cell = agg["cells"]["200tok_c1"]
    assert cell["kvpush"]["requests"] == 8 and cell["pull"]["failed"] == 0
    assert 0 < cell["ttft_median_ratio_vs_pull"] < cell["ttft_median_ratio_vs_push"] < 1
    res = {"engine": agg}
    res = {**report.headline(res), **res}
    assert res["ttft_ratio_vs_pull"] == cell["ttft_median_ratio_vs_pull"]
    assert "200tok_c4" in report.table(res)
    paths = report.plot(res, str(tmp_path))
    assert [Path(p).name for p in paths] == ["cpu-engine.png"]
