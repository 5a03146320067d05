"""The load benchmark's target checks (scripts/load_report.py) and its NixlPush proxy's legs
(scripts/pd_proxy.py), without servers."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / f"scripts/{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(p50: float, p99: float, tpot99: float, failed: int = 0) -> dict[str, Any]:
    return {"p50_ttft_ms": p50, "p99_ttft_ms": p99, "p99_tpot_ms": tpot99, "failed": failed}


def test_targets_cell_by_cell() -> None:
    report = _load("load_report")
    by_rate = {
        8.0: {  # every target met
            "plain": _run(30, 60, 4.0),
            "kvpush": _run(34, 70, 2.9),
            "push": _run(60, 150, 3.0),
        },
        24.0: {  # p50 +6 ms, p99 1.25x, TPOT 0.8x, overhead 6/20 = 0.3, one failure
            "plain": _run(40, 80, 5.0),
            "kvpush": _run(46, 100, 4.0, failed=1),
            "push": _run(60, 120, 3.0),
        },
        96.0: {"plain": _run(100, 600, 9.0), "kvpush": _run(300, 500, 8.0)},  # out of scope
    }
    rows = {r["rate"]: r for r in report.targets(by_rate)}
    ok = rows[8.0]
    assert ok["in_scope"] and ok["ttft_p50_ok"] and ok["ttft_p99_ok"] and ok["tpot_p99_ok"]
    assert ok["overhead_p50_ok"] and ok["no_failures_ok"]
    assert abs(ok["overhead_ratio_p50"] - 4 / 30) < 1e-9
    bad = rows[24.0]
    assert bad["in_scope"]
    assert not any(bad[k] for k in ("ttft_p50_ok", "ttft_p99_ok", "tpot_p99_ok"))
    assert not bad["overhead_p50_ok"] and not bad["no_failures_ok"]
    out = rows[96.0]
    assert not out["in_scope"] and out["overhead_ratio_p50"] is None  # no NixlPush run
    assert "**no**" in report.targets_table(list(rows.values()))


def test_failed_run_is_not_a_pass() -> None:
    report = _load("load_report")
    rows = report.targets({8.0: {"plain": _run(30, 60, 4.0), "kvpush": {"error": "timeout"}}})
    assert rows[0]["ttft_p50_ok"] is None and rows[0]["no_failures_ok"] is False


def test_summary_from_the_folder_or_its_archive(tmp_path: Path) -> None:
    """docs/load/ keeps a run's summary.json packed in vllm-results.tar.gz; a fresh run's
    folder has it as a file. Both read the same, the archive also when named itself."""
    report = _load("load_report")
    summary = {"labels": ["plain"], "mixes": [], "runs": []}
    data = json.dumps(summary).encode()
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "summary.json").write_bytes(data)
    (tmp_path / "docs").mkdir()
    with tarfile.open(tmp_path / "docs" / report.ARCHIVE, "w:gz") as tar:
        info = tarfile.TarInfo("summary.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert report.read_summary(tmp_path / "fresh") == summary
    assert report.read_summary(tmp_path / "docs") == summary
    assert report.main([str(tmp_path / "docs" / report.ARCHIVE)]) == 0
    assert json.loads((tmp_path / "docs" / "targets.json").read_text()) == {}


def test_proxy_legs() -> None:
    proxy = _load("pd_proxy")
    body = {"prompt": "x", "max_tokens": 128, "stream": True, "stream_options": {"a": 1}}
    p = proxy.prefill_body(body)
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 128 and "stream_options" in body  # the client's body kept
    args = argparse.Namespace(prefill_engine_id="push-prefill", side_host="h", side_port=5)
    d = proxy.push_params(args, "abc")
    assert d["remote_request_id"] == "cmpl-abc-0" and d["do_remote_prefill"] is True
    assert (d["remote_engine_id"], d["remote_host"], d["remote_port"]) == ("push-prefill", "h", 5)


def test_answers_cut_short_are_failures(tmp_path: Path) -> None:
    """vLLM's bench counts a stream that ends in an error event after its first token as
    completed. load_bench_gpu counts such answers (shorter than the length the request
    asked for, from the bench's own sampler and seed) and the report fails the run on them."""
    from kvpush.tiny_model import make_tiny_model

    lb = _load("load_bench_gpu")
    model = make_tiny_model(str(tmp_path / "m"), 0)
    mix = {"name": "A", "input_len": 64, "output_len": 32}
    args = argparse.Namespace(range_ratio=0.25, seed=3)
    argv = lb.bench_argv(args, model, "http://127.0.0.1:9", mix, 12, 2.0, tmp_path, "x.json")
    want = lb.expected_lens(argv)
    assert len(want) == 12 and all(24 <= n <= 40 for n in want) and len(set(want)) > 1
    assert lb.expected_lens(argv) == want  # the same seed: the same requests
    got: list[Any] = list(want)
    got[3], got[5] = 1, None
    assert lb.cut_short(want, want) == 0
    assert lb.cut_short(want, got) == 2
    assert lb.cut_short(want, want[:-1]) == 12  # outputs that do not line up: all count
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"completed": 12, "ttfts": [0.1] * 12, "output_lens": got}))
    assert lb.checked({"output_lens": got}, argv, path) == 2
    assert json.loads(path.read_text()) == {"completed": 12, "output_lens": got}

    report = _load("load_report")
    cut = {**_run(30, 60, 2.0), "cut_short": 2}
    rows = report.targets({8.0: {"plain": _run(30, 60, 4.0), "kvpush": cut}})
    assert rows[0]["ttft_p50_ok"] and rows[0]["failed"] == {"plain": 0, "kvpush": 2}
    assert rows[0]["no_failures_ok"] is False
    assert "0 + 2 cut short" in report.table("A", {8.0: {"kvpush": cut}}, ["kvpush"])


def test_a_kvpush_variant_needs_its_tree(tmp_path: Path) -> None:
    """``kvpush@LABEL`` runs kvpush from the tree ``--variant LABEL=DIR`` names (a
    before/after in one call); a label without a tree, or a tree without kvpush, is
    refused before anything starts."""
    import pytest

    lb = _load("load_bench_gpu")
    (tmp_path / "old" / "kvpush").mkdir(parents=True)
    args = lb.parse(["--out", "x", "--contenders", "plain,kvpush@old,kvpush",
                     "--variant", f"old={tmp_path / 'old'}"])  # fmt: skip
    assert args.trees == {"old": str(tmp_path / "old")}
    for bad in (["--contenders", "kvpush@new"], ["--contenders", "push@old"],
                ["--contenders", "kvpush@old", "--variant", f"old={tmp_path}"]):  # fmt: skip
        with pytest.raises(SystemExit):
            lb.parse(["--out", "x", *bad])
    report = _load("load_report")
    assert report.short("kvpush@old") == "kvpush@old" and report.short("push") == "NixlPush"


def test_where_the_ttft_goes() -> None:
    report = _load("load_report")
    plain = {**_run(30, 60, 4.0), "mean_ttft_ms": 32.0}
    plain["servers"] = {"server": {"n": 48, "ttft_ms": 30.5, "queue_ms": 1.0, "prefill_ms": 28.0}}
    kvpush = {**_run(40, 80, 4.0), "mean_ttft_ms": 45.0}
    kvpush["servers"] = {
        "prefill": {"n": 48, "ttft_ms": 41.0, "queue_ms": 2.0, "prefill_ms": 37.5},
        "decode": {"n": 47, "ttft_ms": 50.0, "queue_ms": 9.3, "prefill_ms": 3.0},
    }
    old = _run(50, 90, 5.0)  # a run from before the load script read /metrics
    table = report.timings(
        {2.0: {"plain": plain, "kvpush": kvpush, "push": old}}, list(report.ORDER)
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    assert len(rows) == 4  # head, rule, plain, kvpush; NixlPush's run has no timings
    assert rows[2] == ["2", "plain", "32.0", "30.5", "1.0", "28.0", "1.5", "-", "48"]
    assert rows[3] == ["2", "kvpush", "45.0", "41.0", "2.0", "37.5", "4.0", "9.3", "48 / 47"]
    assert report.timings({2.0: {"push": old}}, ["push"]) == ""


def test_a_traced_run_hop_by_hop(tmp_path: Path) -> None:
    report = _load("load_report")
    marks = []
    for i, t in enumerate((100.0, 100.5, 300.0)):  # the third is after the run's window
        tid = f"t{i}"
        for ev, ms in (("router.recv", 0), ("p_sched.alloc", 4), ("sched.finished", 40),
                       ("router.p_answer", 43 + i), ("router.prepared", 44 + i)):  # fmt: skip
            marks.append({"t": t + ms / 1e3, "ev": ev, "id": tid, "rid": None})
    marks.append({"t": 100.1, "ev": "sched.finished", "id": "t0", "rid": None})  # D's, later
    marks.append({"t": 100.042, "ev": "router.p_piece", "id": "t0", "rid": None})  # t0's alone
    marks.append({"t": 100.0425, "ev": "router.p_head", "id": "t0", "rid": None})
    folder = tmp_path / "trace" / "kvpush"
    folder.mkdir(parents=True)
    (folder / "11.jsonl").write_text("\n".join(json.dumps(m) for m in marks) + "\n")
    row = {"mix": "B", "rate": 2.0, "contender": "kvpush", "tag": "r2", "wall": [99.0, 200.0]}
    row.update(first_token_p=47.0, first_token_d=2.0, first_token_differed=1.0)
    summary = {"runs": [row, {**row, "tag": "warmup"}, {**row, "contender": "plain"}]}
    rows = report.trace_split(tmp_path, summary).splitlines()
    assert len(rows) == 3  # head, rule, the one traced measured run
    cells = [c.strip() for c in rows[2].strip("|").split("|")]
    assert cells[:4] == ["B", "2", "kvpush", "2"]
    assert cells[4:] == ["4.00 / 4.00", "36.00 / 36.00", "3.50 / 3.50", "2.00 / 2.00",
                         "0.50 / 0.50", "1.50 / 1.50", "1.00 / 1.00", "44.50 / 44.50",
                         "47 / 2 (1)"]  # fmt: skip
    assert report.trace_split(tmp_path / "none", summary) == ""
    row.update(first_token_p_unusable=1.0, first_token_p_failed=0.0)  # since the router says why
    cells = [c.strip() for c in report.trace_split(tmp_path, summary).splitlines()[2].split("|")]
    assert cells[-2] == "47 / 2 (1); D's for P's answer unusable / failed: 1 / 0"


def test_router_counts_say_why_only_where_the_router_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router from before the `why` label (a --variant) has no count of why: the run
    keeps none, rather than zeros that would read as "P's answer was always usable"."""
    lb = _load("load_bench_gpu")
    pair = object.__new__(lb.KvpushPair)
    pair.router = argparse.Namespace(url="http://router")
    name = "kvpush_router_first_token_total"
    new = f'{name}{{leg="prefill",why="p_first"}} 5.0\n'
    new += f'{name}{{leg="decode",why="p_unusable"}} 2.0\n'
    old = f'{name}{{leg="prefill"}} 5.0\n{name}{{leg="decode"}} 2.0\n'
    monkeypatch.setattr(lb, "metrics_text", lambda url: new)
    got = lb.router_counts(pair)
    assert got["first_token_p"] == 5.0 and got["first_token_d"] == 2.0
    assert got["first_token_p_unusable"] == 2.0 and got["first_token_p_failed"] == 0.0
    monkeypatch.setattr(lb, "metrics_text", lambda url: old)
    got = lb.router_counts(pair)
    assert got["first_token_d"] == 2.0 and "first_token_p_unusable" not in got
    assert lb.router_counts(object.__new__(lb.Plain)) == {}
