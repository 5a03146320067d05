"""Under load, in vLLM's own benchmark: every contender driven by ``vllm bench serve``.

Contenders (``--contenders``), all started at once on one GPU, each behind the front its
users run it behind:

- ``plain``: one vLLM server, no connector;
- ``kvpush``: kvpush's connector on P and D, ``kvpush router`` in front (both legs at once);
- ``push``: vLLM's ``NixlPushConnector``, scripts/pd_proxy.py ``--mode both`` in front;
- ``pull``: vLLM's ``NixlConnector`` behind vllm-router (``--vllm-pd-disaggregation``), or
  behind scripts/pd_proxy.py ``--mode turn`` when vllm-router is not importable (the
  summary says which).

Idle contenders are frozen (SIGSTOP) while one is measured, as in kvpush_bench.vllm_gpu.
For each mix (``--mix NAME:IN:OUT:REQUESTS:RATE,RATE,...``), each contender is resumed,
warmed up by one short ``vllm bench serve`` run (the same for all), then measured at every
rate by ``vllm bench serve`` itself (its ``main``, called in this process with its own CLI
flags: the random dataset, Poisson arrivals, ``--ignore-eos``, the same ``--seed`` for every
contender, so the same prompts at the same moments). vLLM's result JSONs are kept under
``OUT/json/``; ``OUT/summary.json`` lists them and what was not run (``--deadline``: no run
starts after that many seconds), and each run's ``cut_short``: answers shorter than their
request asked for, which the bench counts as completed. scripts/load_report.py renders the
table, plots and targets.

    python scripts/load_bench_gpu.py --out /tmp/lb --deadline 420 \
        --mix A:2048:128:160:8,24,48,96 --mix B:8192:256:32:2,4,8
    MPS: --mps 50,50 (P and D under a private MPS daemon, that share of SMs each)
    --trace: kvpush's servers and router write their stage marks (kvpush.core.trace) under
    OUT/trace/<contender>/; scripts/load_report.py splits each run's first token with them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpush.deploy.servers import (  # noqa: E402
    Proc,
    free_port,
    metric_in,
    metrics_text,
    sigterm_as_interrupt,
)
from kvpush.tiny_model import make_tiny_model  # noqa: E402
from kvpush_bench import server_metrics  # noqa: E402
from kvpush_bench.pairs import (  # noqa: E402
    InTreePushPair,
    KvpushPair,
    Pair,
    PlainPair,
    PullPair,
    start_pairs,  # noqa: E402
    variant_env,
    variant_trees,
)

PROXY = str(Path(__file__).resolve().parent / "pd_proxy.py")


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Front(Proc):
    """A proxy process (pd_proxy.py or vllm-router) with a ``url`` for wait_healthy."""

    def __init__(self, name: str, argv: list[str], log_dir: str, port: int) -> None:
        self.port = port
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        super().__init__(name, argv, dict(os.environ), Path(log_dir) / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RoleEnv:
    """Mixin: per-role environment (MPS SM shares) for servers named *prefill / *decode."""

    role_env: dict[str, dict[str, str]] = {}

    def _server(self, name: str, kv: Any, core: int, env: dict[str, str], args: Any = None) -> Any:
        role = next((r for r in ("prefill", "decode") if name.endswith(r)), "")
        env = {**env, **self.role_env.get(role, {})}
        return super()._server(name, kv, core, env, args)  # type: ignore[misc]


class Plain(RoleEnv, PlainPair):
    @property
    def front(self) -> str:
        return self.server.url


class Kvpush(RoleEnv, KvpushPair):
    @property
    def front(self) -> str:
        return self.router.url


class Push(RoleEnv, InTreePushPair):
    def _launch(self) -> list[Proc]:
        procs = super()._launch()
        port = free_port()
        argv = [sys.executable, PROXY, "--port", str(port), "--mode", "both"]
        argv += ["--prefill", self.p.url, "--decode", self.d.url]
        argv += ["--prefill-engine-id", "push-prefill"]
        argv += ["--prefill-side-channel", f"127.0.0.1:{self.side}"]
        self.proxy = Front("proxy", argv, self.log_dir, port)
        return [*procs, self.proxy]

    @property
    def front(self) -> str:
        return self.proxy.url


class Pull(RoleEnv, PullPair):
    use_vllm_router = importlib.util.find_spec("vllm_router") is not None

    def _launch(self) -> list[Proc]:
        procs = super()._launch()
        port = free_port()
        if self.use_vllm_router:
            argv = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation"]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
            argv += ["--prefill", self.p.url, "--decode", self.d.url]
            name = "vllm-router"
        else:
            argv = [sys.executable, PROXY, "--port", str(port), "--mode", "turn"]
            argv += ["--prefill", self.p.url, "--decode", self.d.url]
            name = "proxy"
        self.proxy = Front(name, argv, self.log_dir, port)
        return [*procs, self.proxy]

    @property
    def front(self) -> str:
        return self.proxy.url


KINDS: dict[str, type[Pair]] = {"plain": Plain, "kvpush": Kvpush, "push": Push, "pull": Pull}
LABELS = {
    "plain": "one plain vLLM server",
    "kvpush": "kvpush P+D, kvpush router (both legs at once)",
    "push": "vLLM NixlPushConnector P+D, pd_proxy.py (both legs at once)",
    "pull": "vLLM NixlConnector P+D, "
    + ("vllm-router (legs in turn)" if Pull.use_vllm_router else "pd_proxy.py (legs in turn)"),
}


def parse_mix(text: str) -> dict[str, Any]:
    name, inp, out, n, rates = text.split(":")
    return {
        "name": name,
        "input_len": int(inp),
        "output_len": int(out),
        "requests": int(n),
        "rates": [float(r) for r in rates.split(",")],
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="", help="model dir (default: made, bench shape on cuda)")
    p.add_argument(
        "--contenders",
        default="plain,kvpush,push,pull",
        help="also kvpush@LABEL: kvpush from the tree of --variant LABEL=DIR (a before/after)",
    )
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR")
    p.add_argument(
        "--mix", action="append", type=parse_mix, default=[], metavar="N:IN:OUT:REQ:RATES"
    )
    p.add_argument("--range-ratio", type=float, default=0.25)
    p.add_argument("--warmup", type=int, default=24, help="requests of the warm-up run")
    p.add_argument("--deadline", type=float, default=0.0, help="s from start; 0: none")
    p.add_argument("--run-limit", type=float, default=180.0, help="s one bench run may take")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=11264)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=12.0, help="KV cache per server")
    p.add_argument("--gpu-util", type=float, default=0.1, help="start-up check share each")
    p.add_argument("--mps", default="", metavar="P%,D%", help="P and D under MPS, SM shares")
    p.add_argument("--mps-dir", default="/tmp/kvpush-mps", help="MPS pipe dir (the daemon's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace", action="store_true", help="kvpush's stage marks (OUT/trace/<contender>/)"
    )
    args = p.parse_args(argv)
    args.trees = variant_trees(args.variant, p.error)
    for label, tree in args.trees.items():
        if not Path(tree, "kvpush").is_dir():
            p.error(f"--variant {label}={tree}: DIR holds no kvpush package")
    for name in args.contenders.split(","):
        kind, _, label = name.partition("@")
        if kind not in KINDS or (label and (kind != "kvpush" or label not in args.trees)):
            p.error(f"--contenders {name!r}: not one of {', '.join(KINDS)} or kvpush@LABEL")
    if not args.mix:
        args.mix = [parse_mix("A:2048:128:160:8,24,48,96")]
    return args


def server_spec(args: argparse.Namespace) -> dict[str, Any]:
    extra = ["--no-enable-prefix-caching"]
    if args.device != "cuda":
        return {
            "device": args.device,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "extra_args": extra,
        }
    # ServerSpec captures decode graphs up to 32 sequences; capture up to --max-num-seqs
    # (vLLM takes the last --compilation-config given).
    cc = {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "max_cudagraph_capture_size": args.max_num_seqs,
    }
    return {
        "device": "cuda",
        "cuda_graphs": True,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_util,
        "kv_cache_bytes": int(args.kv_cache_gib * 2**30),
        "extra_args": [*extra, "--compilation-config", json.dumps(cc)],
    }


def start_all(args: argparse.Namespace, model: str, names: list[str]) -> dict[str, Pair]:
    out = Path(args.out)
    pairs: dict[str, Pair] = {}
    for name in names:
        kind, _, label = name.partition("@")
        pair = KINDS[kind](model, str(out / "logs" / name), **server_spec(args))
        if label:  # its servers and router import kvpush from that tree
            pair.spec["env"] = variant_env(args.trees[label])
        if args.trace and kind == "kvpush":  # its servers and router mark each stage
            trace_dir = str(out / "trace" / name)
            pair.spec["env"] = {**pair.spec.get("env", {}), "KVPUSH_TRACE_DIR": trace_dir}
        if args.mps:
            p_pct, d_pct = args.mps.split(",")
            mps = {"CUDA_MPS_PIPE_DIRECTORY": args.mps_dir, "CUDA_MPS_LOG_DIRECTORY": args.mps_dir}
            pair.role_env = {  # type: ignore[attr-defined]
                "prefill": {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": p_pct},
                "decode": {**mps, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": d_pct},
            }
        pairs[name] = pair
    return start_pairs(pairs)


def bench_argv(
    args: argparse.Namespace,
    model: str,
    url: str,
    mix: dict[str, Any],
    requests: int,
    rate: float,
    json_dir: Path,
    fname: str,
) -> list[str]:
    """``vllm bench serve``'s own flags for one run."""
    return [
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model, "--dataset-name", "random",
        "--random-input-len", str(mix["input_len"]), "--random-output-len", str(mix["output_len"]),
        "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(requests),
        "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
        "--seed", str(args.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--ready-check-timeout-sec", "60",
        "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(json_dir),
        "--result-filename", fname,
    ]  # fmt: skip


# What --save-detailed adds to a result JSON beyond the output lengths: dropped once a run's
# requests are checked (the JSON is then what vLLM writes without the flag, plus
# ``output_lens``), so docs/load/ stays small.
BULKY = ("input_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def expected_lens(argv: list[str]) -> list[int]:
    """The output length each request of a run asked for (``--ignore-eos``: what a whole
    answer has), from ``vllm bench serve``'s own sampler fed the run's flags and seed."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    a = parser.parse_args(argv)
    return [r.expected_output_len for r in get_samples(a, get_tokenizer(a.model))]


def cut_short(expected: list[int], got: list[Any]) -> int:
    """Requests whose answer ended before its length: ``vllm bench serve`` counts a stream
    that sent a first token as completed even when it ends in an error event, so a failure
    after the first token shows only as a short answer."""
    if len(got) != len(expected):
        return len(expected)  # the run's outputs do not line up with its requests
    return sum(1 for e, g in zip(expected, got, strict=True) if not isinstance(g, int) or g < e)


def checked(res: dict[str, Any], argv: list[str], path: Path) -> int:
    """A run's cut-short count; its JSON on disk loses the bulky per-request fields."""
    short = cut_short(expected_lens(argv), list(res.get("output_lens") or []))
    if path.exists():
        saved = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in saved.items() if k not in BULKY}))
    return short


def _alarm(*_: object) -> None:
    raise TimeoutError("bench run over --run-limit")


def bench(argv: list[str], limit: float) -> dict[str, Any]:
    """One ``vllm bench serve`` run (its main, unchanged), stopped after ``limit`` s."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(limit)))
    try:
        return dict(serve_main(parser.parse_args(argv)))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def scrape_servers(pair: Pair) -> dict[str, dict[str, float]]:
    """server_metrics.scrape() of each of the pair's vLLM servers, by role: ``server`` (the
    plain one) or ``prefill`` and ``decode``; a server that does not answer gives {}."""
    if isinstance(pair, PlainPair):
        by_role = {"server": pair.server}
    else:
        by_role = {"prefill": pair.p, "decode": pair.d}  # type: ignore[attr-defined]
    out: dict[str, dict[str, float]] = {}
    for role, server in by_role.items():
        try:
            out[role] = server_metrics.scrape(server.url)
        except OSError as e:
            _log(f"{role} {server.url}/metrics: {e!r}")
            out[role] = {}
    return out


# The router's counts of whose first token the client got, of D's got because P's answer
# was no plain token or P's leg failed (kvpush.router.streaming.FIRST_WHY; the rest of D's
# came first), and of D's that differed.
FIRST = {
    "first_token_p": ("kvpush_router_first_token_total", {"leg": "prefill"}),
    "first_token_d": ("kvpush_router_first_token_total", {"leg": "decode"}),
    "first_token_p_unusable": ("kvpush_router_first_token_total", {"why": "p_unusable"}),
    "first_token_p_failed": ("kvpush_router_first_token_total", {"why": "p_failed"}),
    "first_token_differed": ("kvpush_router_first_token_mismatch_total", None),
}


def router_counts(pair: Pair) -> dict[str, float]:
    """FIRST read from a kvpush pair's router; {} for other pairs or a router that does
    not answer."""
    if not isinstance(pair, KvpushPair):
        return {}
    try:
        text = metrics_text(pair.router.url)
        out = {k: metric_in(text, name, labels) or 0.0 for k, (name, labels) in FIRST.items()}
    except OSError as e:
        _log(f"router {pair.router.url}/metrics: {e!r}")
        return {}
    if 'why="' not in text:  # a router from before the label (a --variant): no count of why
        out = {k: v for k, v in out.items() if "why" not in (FIRST[k][1] or {})}
    return out


def sweep(
    args: argparse.Namespace, model: str, pairs: dict[str, Pair], t0: float, summary: dict[str, Any]
) -> None:
    out = Path(args.out)
    for mix in args.mix:
        json_dir = out / "json" / mix["name"]
        json_dir.mkdir(parents=True, exist_ok=True)
        # The same order in every mix, the reference first: a run cut by --deadline then
        # leaves whole comparisons with plain, not a mix without its reference.
        for name in pairs:
            pair = pairs[name]
            url = pair.front  # type: ignore[attr-defined]
            plan = [("warmup", 0.0, args.warmup, mix["rates"][-1])]
            plan += [(f"r{r:g}", r, mix["requests"], r) for r in mix["rates"]]
            pair.resume()
            try:
                for tag, rate, n, send_rate in plan:
                    key = f"{mix['name']}/{name}/{tag}"
                    if args.deadline and time.monotonic() - t0 > args.deadline:
                        summary["not_run"].append(key)
                        continue
                    fname = f"{name}-{tag}.json"
                    argv = bench_argv(args, model, url, mix, n, send_rate, json_dir, fname)
                    started, wall = time.monotonic(), time.time()
                    before, counts = scrape_servers(pair), router_counts(pair)
                    try:
                        res = bench(argv, args.run_limit)
                        row = {k: res.get(k) for k in ("completed", "failed", "duration")}
                        row["cut_short"] = checked(res, argv, json_dir / fname)
                        row.update({k: v for k, v in res.items() if k.endswith("_ms")})
                        row["json"] = f"json/{mix['name']}/{fname}"
                        after = scrape_servers(pair)
                        row["servers"] = {
                            role: server_metrics.means(before[role], after[role]) for role in before
                        }
                        now = router_counts(pair)
                        row.update({k: now[k] - counts[k] for k in now.keys() & counts.keys()})
                    except (Exception, TimeoutError) as e:  # noqa: BLE001 - a run's failure is data
                        row = {"error": repr(e)[:500]}
                    row.update(
                        mix=mix["name"],
                        contender=name,
                        tag=tag,
                        rate=rate,
                        requests=n,
                        wall_s=round(time.monotonic() - started, 1),
                        wall=[wall, time.time()],  # (lines the run up with trace marks)
                    )
                    summary["runs"].append(row)
                    shown = ("completed", "failed", "cut_short", "p50_ttft_ms", "p99_tpot_ms")
                    _log(f"{key}: {json.dumps({k: row.get(k) for k in (*shown, 'error')})}")
                    (out / "summary.json").write_text(json.dumps(summary, indent=1))
            finally:
                pair.pause()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = "bench" if args.device == "cuda" else "tiny"
    model = args.model or make_tiny_model(str(out / "model"), args.seed, shape=shape)
    names = [n for n in args.contenders.split(",") if n]
    summary: dict[str, Any] = {
        "labels": {
            n: LABELS.get(n) or f"{LABELS['kvpush']}, from {args.trees[n.partition('@')[2]]}"
            for n in names
        },
        "mixes": args.mix,
        "options": {k: v for k, v in vars(args).items() if k != "mix"},
        "server_flags": server_spec(args),
        "runs": [],
        "not_run": [],
    }
    with sigterm_as_interrupt():
        pairs: dict[str, Pair] = {}
        try:
            pairs = start_all(args, model, names)
            summary["start_s"] = round(time.monotonic() - t0, 1)
            _log(f"all {len(names)} contenders healthy after {summary['start_s']}s")
            for pair in pairs.values():
                pair.pause()
            sweep(args, model, pairs, t0, summary)
        except BaseException as e:
            summary["error"] = repr(e)[-2000:]
            raise
        finally:
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            for pair in pairs.values():
                pair.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
