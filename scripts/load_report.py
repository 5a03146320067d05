"""Render a load benchmark's results (scripts/load_bench_gpu.py): one markdown table and one
plot per mix, ratios against the plain server, and issue 38's targets cell by cell.

    python scripts/load_report.py DIR [--plot]   # prints markdown; writes DIR/targets.json

DIR is a run's folder (scripts/load_bench_gpu.py's OUT): summary.json, which has every number
the report uses, and vLLM's result JSONs its rows name (``json/<mix>/<contender>-<tag>.json``).
docs/load/ keeps both packed, paths unchanged, in DIR/vllm-results.tar.gz; DIR (or that file)
is read the same way.

Targets, at every rate where the plain server's TTFT p99 is under 200 ms: kvpush TTFT p50
<= plain + 5 ms; kvpush TTFT p99 <= 1.2 x plain; kvpush TPOT p99 <= 0.75 x plain; kvpush's
TTFT overhead over plain <= 0.2 x NixlPush's (judged at p50 and at p99, both shown); no
failed request for any contender. A failed request is one vLLM's bench counts as failed or
one whose answer was cut short (``cut_short``, counted by scripts/load_bench_gpu.py: the bench
counts a stream that ends in an error event after its first token as completed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tarfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpush_bench import png  # noqa: E402

ORDER = ("plain", "kvpush", "push", "pull")
ARCHIVE = "vllm-results.tar.gz"
SHORT = {"plain": "plain", "kvpush": "kvpush", "push": "NixlPush", "pull": "Nixl pull"}


def short(name: str) -> str:
    """A contender's name in tables: kvpush@LABEL (a variant) as it is."""
    return SHORT.get(name, name)


def read_summary(d: Path) -> dict[str, Any]:
    """DIR/summary.json, else the one packed in DIR/vllm-results.tar.gz."""
    if (d / "summary.json").exists():
        return dict(json.loads((d / "summary.json").read_text()))
    with tarfile.open(d / ARCHIVE) as tar:
        f = tar.extractfile("summary.json")
        if f is None:
            raise FileNotFoundError(f"{d / ARCHIVE}: summary.json is not a file")
        return dict(json.loads(f.read()))


def cells(summary: dict[str, Any]) -> dict[str, dict[float, dict[str, dict[str, Any]]]]:
    """mix -> rate -> contender -> run row (measured runs only, not the warm-ups)."""
    out: dict[str, dict[float, dict[str, dict[str, Any]]]] = {}
    for row in summary["runs"]:
        if row["tag"] == "warmup":
            continue
        out.setdefault(row["mix"], {}).setdefault(row["rate"], {})[row["contender"]] = row
    return out


def failures(row: dict[str, Any]) -> int:
    """A run's failed requests: failed as vLLM's bench counts them, plus those cut short."""
    return int(row.get("failed") or 0) + int(row.get("cut_short") or 0)


def _failed(row: dict[str, Any]) -> str:
    cut = int(row.get("cut_short") or 0)
    return f"{row.get('failed')}" + (f" + {cut} cut short" if cut else "")


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _pair(row: dict[str, Any] | None, metric: str) -> str:
    if not row or "error" in row:
        return "not run" if not row else "error"
    return f"{_f(row.get(f'p50_{metric}_ms'))} / {_f(row.get(f'p99_{metric}_ms'))}"


def _md(head: Any, rows: list[list[str]]) -> str:
    """A markdown table: ``head``, its rule, then ``rows``."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def table(mix: str, by_rate: dict[float, dict[str, dict[str, Any]]], names: list[str]) -> str:
    head = ["rate (req/s)"]
    for n in names:
        head += [f"{short(n)} TTFT p50 / p99", f"{short(n)} TPOT p50 / p99"]
    head += [f"{short(n)} ITL p99" for n in names]
    head.append("failed (" + " / ".join(short(n) for n in names) + ")")
    rows = []
    for rate in sorted(by_rate):
        runs = by_rate[rate]
        row = [f"{rate:g}"]
        for n in names:
            row += [_pair(runs.get(n), "ttft"), _pair(runs.get(n), "tpot")]
        row += [_f((runs.get(n) or {}).get("p99_itl_ms")) for n in names]
        fails = []
        for n in names:
            r = runs.get(n)
            if not r:
                fails.append("not run")
            elif "error" in r:
                fails.append("run failed")
            else:
                fails.append(_failed(r))
        row.append(" / ".join(fails))
        rows.append(row)
    return _md(head, rows)


def compact(by_rate: dict[float, dict[str, dict[str, Any]]], names: list[str]) -> str:
    """Issue 38's layout: TTFT p50 / p99 of every contender, then TPOT p99 and ITL p99."""
    head = ["rate"] + [f"{short(n)} TTFT p50 / p99" for n in names]
    head += [f"{short(n)} TPOT p99" for n in names] + [f"{short(n)} ITL p99" for n in names]
    head.append("failed")
    rows = []
    for rate in sorted(by_rate):
        runs = by_rate[rate]
        row = [f"{rate:g}"] + [_pair(runs.get(n), "ttft") for n in names]
        row += [_f(_get(runs, n, "p99_tpot_ms")) for n in names]
        row += [_f(_get(runs, n, "p99_itl_ms")) for n in names]
        row.append(str(sum(failures(runs.get(n) or {}) for n in names)))
        rows.append(row)
    return _md(head, rows)


def _get(runs: dict[str, dict[str, Any]], name: str, key: str) -> float | None:
    r = runs.get(name)
    if not r or "error" in r:
        return None
    v = r.get(key)
    return None if v is None else float(v)


def targets(by_rate: dict[float, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rate's target checks; None where a number is missing (not run)."""
    out = []
    for rate in sorted(by_rate):
        runs = by_rate[rate]
        plain99 = _get(runs, "plain", "p99_ttft_ms")
        row: dict[str, Any] = {"rate": rate, "plain_ttft_p99": plain99}
        row["in_scope"] = plain99 is not None and plain99 < 200
        g = {q: {n: _get(runs, n, f"{q}_ttft_ms") for n in ORDER} for q in ("p50", "p99")}
        k50, p50 = g["p50"]["kvpush"], g["p50"]["plain"]
        k99, p99 = g["p99"]["kvpush"], g["p99"]["plain"]
        kt, pt = _get(runs, "kvpush", "p99_tpot_ms"), _get(runs, "plain", "p99_tpot_ms")
        row["ttft_p50_over_plain_ms"] = None if None in (k50, p50) else k50 - p50  # type: ignore[operator]
        row["ttft_p50_ok"] = (
            None if row["ttft_p50_over_plain_ms"] is None else row["ttft_p50_over_plain_ms"] <= 5
        )
        row["ttft_p99_ratio"] = None if None in (k99, p99) else k99 / p99  # type: ignore[operator]
        row["ttft_p99_ok"] = None if row["ttft_p99_ratio"] is None else row["ttft_p99_ratio"] <= 1.2
        row["tpot_p99_ratio"] = None if None in (kt, pt) else kt / pt  # type: ignore[operator]
        row["tpot_p99_ok"] = (
            None if row["tpot_p99_ratio"] is None else row["tpot_p99_ratio"] <= 0.75
        )
        for q in ("p50", "p99"):
            k, p, x = g[q]["kvpush"], g[q]["plain"], g[q]["push"]
            ratio = None
            if None not in (k, p, x) and x - p > 0:  # type: ignore[operator]
                ratio = (k - p) / (x - p)  # type: ignore[operator]
            row[f"overhead_ratio_{q}"] = ratio
            row[f"overhead_{q}_ok"] = None if ratio is None else ratio <= 0.2
        row["failed"] = {n: "run failed" if "error" in r else failures(r) for n, r in runs.items()}
        row["no_failures_ok"] = all(failures(r) == 0 for r in runs.values()) and all(
            "error" not in r for r in runs.values()
        )
        out.append(row)
    return out


def _mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**no**")


def targets_table(rows: list[dict[str, Any]]) -> str:
    head = ("rate", "plain TTFT p99 < 200 ms", "kvpush TTFT p50 - plain (<= 5 ms)",
            "TTFT p99 kvpush/plain (<= 1.2)", "TPOT p99 kvpush/plain (<= 0.75)",
            "overhead kvpush/NixlPush p50 (<= 0.2)", "same at p99", "0 failed")  # fmt: skip
    cells = []
    for r in rows:
        cells.append(
            [
                f"{r['rate']:g}",
                f"{_f(r['plain_ttft_p99'])} ms: {'yes' if r['in_scope'] else 'no (out of scope)'}",
                f"{_f(r['ttft_p50_over_plain_ms'])}: {_mark(r['ttft_p50_ok'])}",
                f"{_f(r['ttft_p99_ratio'], 2)}: {_mark(r['ttft_p99_ok'])}",
                f"{_f(r['tpot_p99_ratio'], 2)}: {_mark(r['tpot_p99_ok'])}",
                f"{_f(r['overhead_ratio_p50'], 2)}: {_mark(r['overhead_p50_ok'])}",
                f"{_f(r['overhead_ratio_p99'], 2)}: {_mark(r['overhead_p99_ok'])}",
                _mark(r["no_failures_ok"]),
            ]
        )
    return _md(head, cells)


def timings(by_rate: dict[float, dict[str, dict[str, Any]]], names: list[str]) -> str:
    """Where each contender's mean TTFT goes, from its servers' own /metrics (the run's
    ``servers``, scripts/load_bench_gpu.py): the first server's (plain's, or P's) TTFT and
    the queue and prefill within it, what the front and HTTP add on top (the client's mean
    minus the server's), and D's queue (which holds its wait for the KV). The servers' means
    also hold the one test request ``vllm bench serve`` sends before a run, alone. Runs
    measured before the load script read /metrics have no such rows."""
    head = ("rate", "contender", "client TTFT mean", "server TTFT mean (plain or P)",
            "queued", "prefill", "client - server", "D queued (with KV wait)",
            "requests seen (server / D)")  # fmt: skip
    rows = []
    for rate in sorted(by_rate):
        for n in names:
            row = by_rate[rate].get(n) or {}
            roles = row.get("servers")
            if not roles:
                continue
            first = roles.get("server") or roles.get("prefill") or {}
            d = roles.get("decode") or {}
            client, server = row.get("mean_ttft_ms"), first.get("ttft_ms")
            front = None if client is None or server is None else client - server
            seen = f"{first.get('n')}" + (f" / {d.get('n')}" if d else "")
            rows.append([f"{rate:g}", short(n), _f(client), _f(server), _f(first.get("queue_ms")),
                         _f(first.get("prefill_ms")), _f(front),
                         _f(d.get("queue_ms")) if d else "-", seen])  # fmt: skip
    return _md(head, rows) if rows else ""


# A traced run's first token, hop by hop: (label, from mark, to mark), kvpush.core.trace.
HOPS = (
    ("router -> P's scheduler", "router.recv", "p_sched.alloc"),
    ("P's queue and forward", "p_sched.alloc", "sched.finished"),
    ("P's output -> router", "sched.finished", "router.p_answer"),
    # Since the router marks P's first piece and takes P's head from the pieces as they
    # come (kvpush.router.head.Early), before the whole answer is in.
    ("P's output -> its first piece at router", "sched.finished", "router.p_piece"),
    ("router: P's first piece -> head", "router.p_piece", "router.p_head"),
    ("router: P's head -> client", "router.p_head", "router.prepared"),
    ("router: P's answer -> client", "router.p_answer", "router.prepared"),
    ("router: in -> client", "router.recv", "router.prepared"),
)


def trace_split(d: Path, summary: dict[str, Any]) -> str:
    """Each traced kvpush run's first token hop by hop (HOPS), median / mean ms over the
    transfers whose ``router.recv`` falls in the run's wall-clock window (its ``wall``),
    from the marks under DIR/trace/<contender>/ (scripts/load_bench_gpu.py --trace); and
    whose first token the client got, by the router's counts (runs since they were read)."""
    from kvpush.core import trace
    from kvpush_bench.stages import by_transfer

    head = ["mix", "rate", "contender", "transfers", *(h[0] for h in HOPS)]
    head.append("first token from P / D (D's differed)")
    rows = []
    read: dict[str, list[dict[str, float]]] = {}
    for row in summary["runs"]:
        folder = d / "trace" / row["contender"]
        if row["tag"] == "warmup" or "wall" not in row or not folder.is_dir():
            continue
        if row["contender"] not in read:
            read[row["contender"]] = list(by_transfer(trace.read(str(folder))).values())
        t0, t1 = row["wall"]
        marks = [m for m in read[row["contender"]] if t0 <= m.get("router.recv", -1.0) <= t1]
        cells_ = [row["mix"], f"{row['rate']:g}", short(row["contender"]), str(len(marks))]
        for _, a, b in HOPS:
            ms = [(m[b] - m[a]) * 1e3 for m in marks if a in m and b in m]
            cells_.append(f"{statistics.median(ms):.2f} / {statistics.mean(ms):.2f}" if ms else "-")
        counts = [row.get(k) for k in ("first_token_p", "first_token_d", "first_token_differed")]
        cell = "-" if None in counts else "{:g} / {:g} ({:g})".format(*counts)
        why = [row.get(k) for k in ("first_token_p_unusable", "first_token_p_failed")]
        if None not in counts and None not in why:  # runs since the router said why
            cell += "; D's for P's answer unusable / failed: {:g} / {:g}".format(*why)
        cells_.append(cell)
        rows.append(cells_)
    return _md(head, rows) if rows else ""


def plot(
    mix: str, by_rate: dict[float, dict[str, dict[str, Any]]], names: list[str], path: Path
) -> None:
    """TTFT and TPOT, p50 (solid) and p99 (dashed), against the rate, every contender;
    a failed request count above a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rates = sorted(by_rate)
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        for i, n in enumerate(names):
            color = f"C{i}"
            for q, style in (("p50", "-"), ("p99", "--")):
                xs = [r for r in rates if _get(by_rate[r], n, f"{q}_{metric}_ms") is not None]
                ys = [_get(by_rate[r], n, f"{q}_{metric}_ms") for r in xs]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{short(n)} {q}")
            for r in rates:
                failed = failures(by_rate[r].get(n) or {})
                y = _get(by_rate[r], n, f"p99_{metric}_ms")
                if failed and y is not None:
                    ax.annotate(f"{failed} failed", (r, y), color=color, fontsize=7)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{metric.upper()} ms")
        ax.set_yscale("log")
        ax.set_title(f"mix {mix}: {metric.upper()} p50 (solid) / p99 (dashed)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png.save(fig, path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir", help="a run's folder, or its vllm-results.tar.gz")
    p.add_argument("--plot", action="store_true", help="write DIR/load-<mix>.png")
    p.add_argument("--compact", action="store_true", help="issue 38's table layout")
    args = p.parse_args(argv)
    d = Path(args.dir)
    if d.is_file():  # DIR/vllm-results.tar.gz
        d = d.parent
    summary = read_summary(d)
    names = [n for n in ORDER if n in summary["labels"]]
    names += [n for n in summary["labels"] if n not in ORDER]  # variants, kvpush@LABEL
    mixes = {m["name"]: m for m in summary["mixes"]}
    report: dict[str, Any] = {}
    for mix, by_rate in cells(summary).items():
        m = mixes[mix]
        print(f"\n### Mix {mix}: {m['input_len']} in / {m['output_len']} out, "
              f"{m['requests']} requests per rate\n")  # fmt: skip
        print(compact(by_rate, names) if args.compact else table(mix, by_rate, names))
        rows = targets(by_rate)
        report[mix] = rows
        split = timings(by_rate, names)
        if split:
            print(f"\nWhere the mean TTFT goes (mix {mix}; vLLM's /metrics, ms):\n")
            print(split)
        print(f"\nTargets (mix {mix}):\n")
        print(targets_table(rows))
        if args.plot:
            plot(mix, by_rate, names, d / f"load-{mix}.png")
    split = trace_split(d, summary)
    if split:
        print("\nkvpush's first token hop by hop (its stage marks; median / mean ms):\n")
        print(split)
    if summary.get("not_run"):
        print(f"\nNot run (deadline): {', '.join(summary['not_run'])}")
    (d / "targets.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
