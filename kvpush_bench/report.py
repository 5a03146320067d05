"""Results of `python -m kvpush_bench bench`: the headline numbers, the summary table, PNG
plots, the doc.

``headline`` pulls the top-level numbers and judges them against issue 5's targets;
``table`` renders the summary printed at the end; ``plot`` writes the PNGs (matplotlib,
Agg backend); ``update_doc`` rewrites only the "CPU" section of docs/benchmarks.md and
keeps every other section (a GPU section may live there too).
"""

from __future__ import annotations

import os
import re
from typing import Any

from kvpush_bench import png

TARGETS = {
    "ttft_ratio_vs_pull": ("<=", 0.5),
    "ttft_ratio_vs_push": ("<=", 0.8),
    "write_ratio_vs_raw": (">=", 0.95),
    "step_us_idle": ("<=", 20.0),
    "step_us_1000": ("<=", 200.0),
    "idle_cpu_percent": ("<", 0.5),
}
CONFIG_NAMES = {
    "kvpush": "kvpush",
    "kvpush-finished": "kvpush (hand_over: finished)",
    "push": "vLLM push",
    "pull": "vLLM pull",
}
COLORS = {"kvpush": "#1f77b4", "kvpush-finished": "#2ca02c", "push": "#ff7f0e", "pull": "#7f7f7f"}


def configs_of(eng: dict[str, Any]) -> list[str]:
    """The engine run's configurations, kvpush first."""
    cfgs = list(eng["options"]["configs"])
    return sorted(cfgs, key=lambda c: (c != "kvpush", list(CONFIG_NAMES).index(c)))


def headline(res: dict[str, Any]) -> dict[str, Any]:
    """Top-level numbers (None where a part did not run) and whether each meets its target."""
    out: dict[str, Any] = {k: None for k in TARGETS}
    eng = res.get("engine")
    if eng:
        cell = eng["cells"].get("200tok_c1", {})
        for other in configs_of(eng)[1:]:  # ttft_ratio_vs_push, ttft_ratio_vs_pull
            out[f"ttft_ratio_vs_{other}"] = cell.get(f"ttft_median_ratio_vs_{other}")
    if res.get("transport"):
        out["write_ratio_vs_raw"] = res["transport"]["write_ratio_vs_raw"]
        out["write_ratio_vs_raw_runs"] = res["transport"].get("write_ratio_vs_raw_runs")
        out["descriptors_equal_runs"] = res["transport"]["descriptors_equal_runs"]
    if res.get("step_cost"):
        sc = res["step_cost"]
        out["step_us_idle"] = sc.get("step_us_0")
        out["step_us_1000"] = sc.get("step_us_1000")
    if res.get("idle_cpu"):
        out["idle_cpu_percent"] = res["idle_cpu"]["idle_cpu_percent"]
    targets = {}
    for key, (op, bound) in TARGETS.items():
        v = out[key]
        met = (
            None
            if v is None
            else (v <= bound if op == "<=" else v >= bound if op == ">=" else v < bound)
        )
        targets[key] = {"value": v, "target": f"{op} {bound:g}", "met": met}
    out["targets"] = targets
    return out


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(res: dict[str, Any]) -> str:
    lines: list[str] = []
    eng = res.get("engine")
    if eng:
        cfgs, others = configs_of(eng), configs_of(eng)[1:]
        for metric, what in (("ttft", "TTFT"), ("e2e", "end-to-end")):
            lines.append(
                f"Engine level: client {what}, ms: median (p90) [failed]; kvpush / other at median"
            )
            lines.append(
                f"  {'cell':<10}"
                + "".join(f"{CONFIG_NAMES[c][:24]:>26}" for c in cfgs)
                + "".join(f"{'/' + c:>10}" for c in others)
            )
            for key, cell in eng["cells"].items():
                row = f"  {key:<10}"
                for c in cfgs:
                    t = cell[c][f"{metric}_ms"]
                    row += (
                        f"{_fmt(t['median']):>12} ({_fmt(t['p90'])}) [{cell[c]['failed']}]".rjust(
                            26
                        )
                    )
                for c in others:
                    row += f"{_fmt(cell.get(f'{metric}_median_ratio_vs_{c}'), 2):>10}"
                lines.append(row)
        idle = eng.get("idle_cpu_percent") or {}
        if idle:
            lines.append(
                "  idle CPU of each pair (% of a core, median): "
                + ", ".join(f"{CONFIG_NAMES[c]} {_fmt(v['median'])}" for c, v in idle.items())
            )
    tr = res.get("transport")
    if tr:
        lines.append(f"Transport: {tr['total_mib']} MiB in 64 KiB blocks, GiB/s (median, p90)")
        for pat, row in tr["patterns"].items():
            d, raw, kv = row["descriptors"], row["raw_gib_s"], row["kvpush_gib_s"]
            rr = row["raw_runs_gib_s"]
            lines.append(
                f"  {pat:<11} raw {_fmt(raw['median'], 2):>5} ({_fmt(raw['p90'], 2)})  "
                f"raw_runs {_fmt(rr['median'], 2):>5} ({_fmt(rr['p90'], 2)})  "
                f"kvpush {_fmt(kv['median'], 2):>5} ({_fmt(kv['p90'], 2)})"
                f"  kvpush/raw {_fmt(row['ratio_vs_raw'], 3)}"
                f" (/raw_runs {_fmt(row['ratio_vs_raw_runs'], 3)})  descriptors kvpush "
                f"{d.get('kvpush')} = runs {d.get('runs')} (raw {d.get('raw')})"
                f"  bytes ok: {row['verified']}"
            )
    sc = res.get("step_cost")
    if sc:
        lines.append("Main-thread cost per engine step, us (median / p90 of the sum of calls)")
        for role, by_n in sc["roles"].items():
            parts = [
                f"{n:>4} in flight {_fmt(v['calls_us']['total']['median'])} / "
                f"{_fmt(v['calls_us']['total']['p90'])}"
                for n, v in by_n.items()
            ]
            lines.append(f"  {role.upper()}: " + ";  ".join(parts))
    ic = res.get("idle_cpu")
    if ic:
        p = ic["percent_of_core"]
        lines.append(
            f"Idle worker CPU over {ic['seconds']:g}s: P {p['p_worker']:.3f} %, "
            f"D {p['d_worker']:.3f} % of a core (no-worker floor {p['floor']:.3f} %)"
        )
    lines.append("Targets:")
    for key, t in headline(res)["targets"].items():
        state = {True: "met", False: "MISSED", None: "not run"}[t["met"]]
        lines.append(f"  {key:<20} {_fmt(t['value'], 3):>9}  target {t['target']:<8} {state}")
    return "\n".join(lines)


def plot(res: dict[str, Any], out_dir: str, prefix: str = "cpu-") -> list[str]:
    """Write the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths: list[str] = []
    eng = res.get("engine")
    if eng:
        cfgs = configs_of(eng)
        concs = eng["options"]["concurrency"]
        sizes = eng["options"]["sizes"]
        fig, axes = plt.subplots(2, len(concs), figsize=(5 * len(concs), 7), squeeze=False)
        for row, metric in enumerate(("ttft_ms", "e2e_ms")):
            for col, conc in enumerate(concs):
                ax = axes[row][col]
                width = 0.8 / len(cfgs)
                for i, c in enumerate(cfgs):
                    cells = [eng["cells"][f"{s}tok_c{conc}"][c][metric] for s in sizes]
                    med = [x["median"] or 0 for x in cells]
                    p90 = [max(0.0, (x["p90"] or 0) - (x["median"] or 0)) for x in cells]
                    xs = [j + (i - (len(cfgs) - 1) / 2) * width for j in range(len(sizes))]
                    ax.bar(
                        xs,
                        med,
                        width,
                        yerr=[[0] * len(med), p90],
                        capsize=3,
                        label=CONFIG_NAMES[c],
                        color=COLORS[c],
                    )
                ax.set_xticks(range(len(sizes)), [f"{s} tok" for s in sizes])
                name = "TTFT" if metric == "ttft_ms" else "end-to-end"
                ax.set_title(f"{name}, concurrency {conc}")
                ax.set_yscale("log")  # p90s of the in-tree pairs run to seconds
                ax.set_ylabel("ms, log (bar: median, whisker: p90)")
        axes[0][0].legend()
        fig.tight_layout()
        paths.append(_save(fig, out_dir, f"{prefix}engine.png"))
    tr = res.get("transport")
    if tr:
        fig, ax = plt.subplots(figsize=(6, 4))
        pats = list(tr["patterns"])
        modes = {
            "raw": "raw NIXL, per block",
            "raw_runs": "raw NIXL, per run",
            "kvpush": "kvpush",
        }
        colors = {
            "raw": "#7f7f7f",
            "raw_runs": "#c7c7c7",
            "kvpush": COLORS["kvpush"],
        }
        # kvpush_thread only in results from before the writer thread was removed (issue 20)
        modes = {
            m: v for m, v in modes.items() if all(f"{m}_gib_s" in tr["patterns"][p] for p in pats)
        }
        for i, mode in enumerate(modes):
            vals = [tr["patterns"][p][f"{mode}_gib_s"] for p in pats]
            xs = [j + (i - 1) * 0.25 for j in range(len(pats))]
            err = [
                [max(0.0, v["median"] - v["min"]) for v in vals],
                [max(0.0, v["max"] - v["median"]) for v in vals],
            ]
            ax.bar(
                xs,
                [v["median"] for v in vals],
                0.2,
                yerr=err,
                capsize=3,
                label=modes[mode],
                color=colors[mode],
            )
        ax.set_xticks(range(len(pats)), pats)
        ax.set_ylabel("GiB/s (median, whiskers min-max)")
        ax.set_title(f"WRITE {tr['total_mib']} MiB in 64 KiB blocks")
        ax.legend()
        fig.tight_layout()
        paths.append(_save(fig, out_dir, f"{prefix}transport.png"))
    sc = res.get("step_cost")
    if sc:
        roles = list(sc["roles"])
        fig, axes = plt.subplots(1, len(roles), figsize=(5 * len(roles), 4), squeeze=False)
        for ax, role in zip(axes[0], roles, strict=True):
            by_n = sc["roles"][role]
            ns = list(by_n)
            calls = [k for k in by_n[ns[0]]["calls_us"] if k not in ("total", "meta_pickle")]
            bottom = [0.0] * len(ns)
            for call in calls:
                vals = [by_n[n]["calls_us"][call]["median"] or 0.0 for n in ns]
                ax.bar(range(len(ns)), vals, bottom=bottom, label=call)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
            ax.set_xticks(range(len(ns)), [f"{n} in flight" for n in ns])
            ax.set_ylabel("us per step (medians, stacked)")
            ax.set_title(f"{role.upper()}: connector calls per engine step")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir, f"{prefix}step-cost.png"))
    return paths


def _save(fig: Any, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    png.save(fig, path, dpi=100)
    plt.close(fig)
    return path


def update_doc(path: str, section: str, heading: str = "## CPU") -> None:
    """Replace (or append) the ``heading`` section of ``path``; other sections stay as they are."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if not text.strip():
        text = "# Benchmarks\n\n"
    body = section.rstrip() + "\n"
    pattern = re.compile(rf"^{re.escape(heading)}[^\n]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: body + "\n", text, count=1)
    else:
        text = text.rstrip() + "\n\n" + body
    with open(path, "w") as f:
        f.write(text.rstrip() + "\n")
