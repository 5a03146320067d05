"""Real vLLM on a GPU: TTFT of one plain server and of P/D pairs, side by side in one run.

Every contender (``--configs``: plain, kvpush, push, pull; see kvpush_bench.pairs) is
started at once on the same GPU (P and D of a pair share it), then all are frozen
(SIGSTOP) and measured one at a time: resumed, warmed up the same way, sent the same
prompts, frozen again (idle in-tree pairs keep NIXL progress threads spinning, which
slowed whichever contender was measured beside them by up to 1.6x), in rounds whose
order rotates. Decode steps run as CUDA graphs (``--eager``: none), for every server. A cell is
(prompt size, concurrency): ``concurrency`` requests sent at once and waited for (a
batch), repeated. Every request
is recorded; a failed one is counted and kept out of the percentiles, never dropped
silently. The disaggregation overhead of a pair is its TTFT minus the plain server's at
the same percentile in the same cell. ``--trace`` also records kvpush's stage marks
(kvpush.core.trace) and reports where the time goes per cell.

    python -m kvpush_bench.vllm_gpu --out DIR [--trace] [--sizes 256,2048,8000] ...
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpush.core import trace
from kvpush.tiny_model import make_tiny_model
from kvpush_bench import png
from kvpush_bench.engine import prompts_for
from kvpush_bench.pairs import (
    LABELS,
    Pair,
    Sample,
    make_pair,
    start_pairs,
    variant_env,
    variant_trees,
)
from kvpush_bench.stages import breakdown, timelines
from kvpush_bench.stats import ratio, summary


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvpush_bench.vllm_gpu", description=__doc__)
    p.add_argument("--out", required=True, help="results: JSON, plot, server logs")
    p.add_argument("--model", default="", help="model dir (default: the bench shape, made)")
    p.add_argument("--configs", default="plain,kvpush,push,pull")
    p.add_argument("--sizes", default="256,2048,8000", help="prompt tokens")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="per cell and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="requests per size, each contender")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kv-cache-gib", type=float, default=6.0, help="KV cache per server")
    p.add_argument("--gpu-util", type=float, default=0.1, help="start-up memory share each")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (vLLM --enforce-eager)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    p.add_argument("--trace", action="store_true", help="kvpush stage marks per request")
    p.add_argument("--kvpush-options", default="{}", help="JSON: kv_connector_extra_config")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="an A/B contender kvpush@LABEL whose P and D import kvpush from DIR (a source "
        "tree, e.g. a git worktree of another commit); name it in --configs",
    )
    p.add_argument(
        "--decode-args",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="a contender kvpush@LABEL whose decoder gets these further vLLM flags (e.g. "
        "sync='--no-async-scheduling'); with a --variant of the same label, from that tree",
    )
    p.add_argument(
        "--decode-env",
        action="append",
        default=[],
        metavar="LABEL=KEY=VALUE",
        help="a contender kvpush@LABEL whose decoder's environment has KEY=VALUE too "
        "(repeatable; e.g. an experiment's sitecustomize dir first on PYTHONPATH)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="LABEL=KEY=VALUE",
        help="a contender kvpush@LABEL whose processes (P, D, router) have KEY=VALUE too",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.d_args = {}  # label -> further vLLM flags of that variant's decoder
    for v in args.decode_args:
        label, sep, flags = v.partition("=")
        if not (sep and label):
            p.error(f"--decode-args {v!r}: expected LABEL=FLAGS")
        args.d_args[label] = shlex.split(flags)
    args.d_env = _envs(args.decode_env, "--decode-env", p.error)  # that variant's decoder
    args.env = _envs(args.env, "--env", p.error)  # that variant's P, D and router
    args.trees = variant_trees(args.variant, p.error)  # label -> source tree
    for cfg in args.configs.split(","):
        label = cfg.partition("@")[2] if cfg.startswith("kvpush@") else ""
        if label and not any(label in d for d in (args.trees, args.d_args, args.d_env, args.env)):
            p.error(
                f"{cfg} in --configs: no --variant {label}=DIR, --decode-args {label}=..., "
                f"--decode-env {label}=... or --env {label}=..."
            )
    return args


def _envs(values: list[str], flag: str, error: Any) -> dict[str, dict[str, str]]:
    """LABEL=KEY=VALUE settings -> label -> environment."""
    out: dict[str, dict[str, str]] = {}
    for v in values:
        label, _, pair = v.partition("=")
        key, sep, value = pair.partition("=")
        if not (label and key and sep):
            error(f"{flag} {v!r}: expected LABEL=KEY=VALUE")
        out.setdefault(label, {})[key] = value
    return out


def _variant_label(args: argparse.Namespace, label: str) -> str:
    tree = args.trees.get(label)
    flags = " ".join(args.d_args.get(label, []))
    d_env = " ".join(f"{k}={v}" for k, v in args.d_env.get(label, {}).items())
    env = " ".join(f"{k}={v}" for k, v in args.env.get(label, {}).items())
    return (
        "kvpush"
        + (f" as in {tree}" if tree else "")
        + (f", environment {env}" if env else "")
        + (f", decoder {flags}" if flags else "")
        + (f", decoder's environment {d_env}" if d_env else "")
    )


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.device == "cpu":
        return {"device": "cpu", "max_model_len": args.max_model_len}
    return {
        "cuda_graphs": not args.eager,
        "device": "cuda",
        "max_model_len": args.max_model_len,
        "max_num_seqs": 16,
        "max_num_batched_tokens": args.max_model_len,  # a whole prompt fits one step
        "gpu_memory_utilization": args.gpu_util,
        "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
    }


def start_all(args: argparse.Namespace, model: str, configs: list[str]) -> dict[str, Pair]:
    """Every contender at once (each waits for its own health); a failed start is fatal."""
    out = Path(args.out)
    pairs: dict[str, Pair] = {}
    for cfg in configs:
        pair = make_pair(cfg, model, str(out / "logs" / cfg), **_spec(args))
        if cfg.startswith("kvpush"):
            opts = json.loads(args.kvpush_options)
            pair.options = {**pair.options, **opts}  # type: ignore[attr-defined]
            env: dict[str, str] = {}
            if args.trace:
                env["KVPUSH_TRACE_DIR"] = str(out / "trace" / cfg)
            label = cfg.partition("@")[2]
            pair.decode_args = args.d_args.get(label, [])  # type: ignore[attr-defined]
            pair.decode_env = args.d_env.get(label, {})  # type: ignore[attr-defined]
            if label in args.trees:
                env.update(variant_env(args.trees[label]))
            env.update(args.env.get(label, {}))
            pair.spec["env"] = env
        pairs[cfg] = pair
    return start_pairs(pairs)


def send_batch(pair: Pair, prompts: list[list[int]], args: argparse.Namespace) -> list[Sample]:
    """``prompts`` sent at the same moment; returns when every answer is in."""
    got: list[Sample | None] = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            got[i] = pair.send(prompts[i], args.max_tokens, args.timeout)
        except Exception as e:  # a client-side failure is a failed request, not a crash
            got[i] = Sample(False, error=repr(e)[:300])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [s if s is not None else Sample(False, error="no answer") for s in got]


def warm_up(
    pair: Pair, sizes: tuple[int, ...], concs: tuple[int, ...], ns: Any, round_no: int
) -> None:
    """The same for every contender at every activation: ``--warmup`` requests of each
    size one at a time, then one batch of each concurrency (prompts never measured, new
    in every round, so that prefix caching never skips a warm-up's prefill)."""
    for size in sizes:
        for prompt in prompts_for(-1 - round_no, size, ns.warmup, ns.seed, -1):
            pair.send(prompt, ns.max_tokens, ns.timeout)
        for c in concs:
            send_batch(pair, prompts_for(-1 - round_no, size, c, ns.seed, -1 - c), ns)


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = [c for c in args.configs.split(",") if c]
    sizes, concs = _ints(args.sizes), _ints(args.concurrency)
    if max(sizes) + args.max_tokens > args.max_model_len:
        raise SystemExit("--max-model-len must hold the largest prompt and --max-tokens")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or make_tiny_model(str(out / "model"), args.seed, shape="bench")
    t0 = time.monotonic()
    pairs = start_all(args, model, configs)
    _log(f"all {len(configs)} contenders healthy after {time.monotonic() - t0:.0f}s")
    records: list[dict[str, Any]] = []
    samples: dict[tuple[str, int, int], list[Sample]] = {}
    try:
        for pair in pairs.values():
            pair.pause()
        for r in range(args.rounds):
            k = r % len(configs)
            for cfg in configs[k:] + configs[:k]:
                pairs[cfg].resume()
                warm_up(pairs[cfg], sizes, concs, args, r)
                for size in sizes:
                    for c in concs:
                        n = -(-args.requests // c) * c
                        prompts = prompts_for(r, size, n, args.seed, c)
                        got: list[Sample] = []
                        for i in range(0, n, c):
                            got += send_batch(pairs[cfg], prompts[i : i + c], args)
                        samples.setdefault((cfg, size, c), []).extend(got)
                        for s in got:
                            records.append(
                                {
                                    "config": cfg,
                                    "round": r,
                                    "size": size,
                                    "concurrency": c,
                                    **asdict(s),
                                }
                            )
                        ok = [s.ttft_s * 1e3 for s in got if s.ok]
                        med = summary(ok, 1)["median"]
                        _log(
                            f"r{r + 1} {cfg:7} {size:>5} tok c={c}: {len(ok)}/{n} ok, "
                            f"TTFT p50 {med} ms"
                        )
                pairs[cfg].pause()
    finally:
        for pair in pairs.values():
            pair.stop()
    result = aggregate(samples, configs, sizes, concs)
    result["labels"] = {
        c: LABELS.get(c) or _variant_label(args, c.partition("@")[2]) for c in configs
    }
    result["options"] = {k: v for k, v in vars(args).items()}
    result["samples"] = records
    if args.trace:
        result["stages"] = {}
        for cfg in configs:
            if not (out / "trace" / cfg).is_dir():
                continue
            events = trace.read(str(out / "trace" / cfg))
            result["stages"][cfg] = {
                f"{size}tok_c{c}": breakdown(samples.get((cfg, size, c), []), events)
                for size in sizes
                for c in concs
            }
            result.setdefault("timelines", {})[cfg] = {
                f"{size}tok_c{c}": timelines(samples.get((cfg, size, c), []), events)
                for size in sizes
                for c in concs
            }
    return result


def aggregate(
    samples: dict[tuple[str, int, int], list[Sample]],
    configs: list[str],
    sizes: tuple[int, ...],
    concs: tuple[int, ...],
) -> dict[str, Any]:
    cells: dict[str, Any] = {}
    for size in sizes:
        for c in concs:
            cell: dict[str, Any] = {"size": size, "concurrency": c}
            for cfg in configs:
                got = samples.get((cfg, size, c), [])
                ok = [s.ttft_s * 1e3 for s in got if s.ok]
                cell[cfg] = {
                    "requests": len(got),
                    "failed": len(got) - len(ok),
                    "errors": sorted({s.error for s in got if not s.ok})[:5],
                    "ttft_ms": summary(ok, 2),
                    # kvpush's first token is P's (kvpush.router.head): the second shows
                    # when D's own output began.
                    "second_token_ms": summary(
                        [s.second_s * 1e3 for s in got if s.ok and s.second_s], 2
                    ),
                    "e2e_ms": summary([s.total_s * 1e3 for s in got if s.ok], 2),
                }
            plain = cell.get("plain", {}).get("ttft_ms", {})
            # The overhead against the server users run (vLLM's defaults), and against one
            # with prefix caching off, which skips the block hashing every connector pays.
            for ref, key in (("plain", "overhead_ms"), ("plain-nocache", "overhead_nocache_ms")):
                base = cell.get(ref, {}).get("ttft_ms", {})
                for cfg in configs:
                    if cfg.startswith("plain") or not base:
                        continue
                    mine = cell[cfg]["ttft_ms"]
                    cell[cfg][key] = {
                        q: None if None in (mine[q], base[q]) else round(mine[q] - base[q], 2)
                        for q in ("median", "p90")
                    }
            for cfg in configs:
                if cfg.startswith("kvpush") and "push" in cell and plain:
                    a = cell[cfg].get("overhead_ms", {}).get("median")
                    b = cell["push"].get("overhead_ms", {}).get("median")
                    cell[f"overhead_ratio_{cfg}_vs_push"] = ratio(a, b)
            cells[f"{size}tok_c{c}"] = cell
    return {"cells": cells}


def plot(result: dict[str, Any], path: str) -> None:
    """TTFT p50 per prompt size, one panel per concurrency, a bar per contender; a second
    row the same for the second token (streamed runs record it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    concs = sorted({v["concurrency"] for v in cells.values()})
    sizes = sorted({v["size"] for v in cells.values()})
    configs = list(result["labels"])
    rows = [("ttft_ms", "TTFT")]
    if all(
        cell[cfg].get("second_token_ms", {}).get("median")
        for cell in cells.values()
        for cfg in configs
    ):
        rows.append(("second_token_ms", "second token"))
    fig, axes = plt.subplots(
        len(rows), len(concs), figsize=(6 * len(concs), 4 * len(rows)), squeeze=False
    )
    width = 0.8 / len(configs)
    for (key, what), line in zip(rows, axes, strict=True):
        for ax, c in zip(line, concs, strict=True):
            for i, cfg in enumerate(configs):
                meds = [cells[f"{s}tok_c{c}"][cfg][key]["median"] or 0 for s in sizes]
                p90s = [cells[f"{s}tok_c{c}"][cfg][key]["p90"] or 0 for s in sizes]
                xs = [j + i * width for j in range(len(sizes))]
                ax.bar(xs, meds, width, label=cfg)
                ax.scatter(xs, p90s, marker="_", color="black", s=80)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(s) for s in sizes])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(f"{what} ms (bar p50, tick p90)")
            ax.set_yscale("log")
            ax.set_title(f"{what}, {c} request(s) at once")
            ax.legend(fontsize=8)
    fig.tight_layout()
    png.save(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, str(out / "ttft.png"))
    except Exception as e:  # the JSON is saved; a plot error must not lose the run
        _log(f"plot failed: {e!r}")
    print(json.dumps({k: v for k, v in result.items() if k in ("cells", "stages")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
