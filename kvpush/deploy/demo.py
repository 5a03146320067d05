"""The main demo: a prefiller and a decoder vLLM server with kvpush, the router in front.

Sends a batch of prompts through the router (both legs at once), shows outputs and
per-request transfer stats, and with ``check`` compares every output with one plain
vLLM server's greedy output. Everything started is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import os
import random
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.deploy.client import Reply, request
from kvpush.deploy.servers import (
    RouterProc,
    ServerSpec,
    VllmServer,
    free_port,
    kvpush_config,
    metric,
    wait_healthy,
)

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "jovial bakers near river banks under silver moons and golden fields"
).split()


def default_model_dir() -> str:
    home = os.environ.get("KVPUSH_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvpush"
    )
    return os.path.join(home, "tiny-model")


def ensure_model(path: str) -> str:
    from kvpush.tiny_model import make_tiny_model

    return make_tiny_model(path)


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 160))) for _ in range(n)]


@dataclass
class VllmDemoOptions:
    requests: int = 8
    concurrency: int = 4
    max_tokens: int = 16
    model: str = ""
    check: bool = False
    workdir: str = ""
    seed: int = 0


class Cluster:
    """P and D with kvpush plus the router; a context manager that always cleans up."""

    def __init__(
        self,
        model: str,
        log_dir: str,
        router_args: list[str] | None = None,
        max_model_len: int = 512,
        decode_args: list[str] | None = None,  # further vLLM flags for D
        **extra: Any,
    ) -> None:
        self.side_port = free_port()
        self.p = VllmServer(
            ServerSpec(
                "prefill",
                model,
                kv_config=kvpush_config("kv_producer", "prefill", self.side_port, **extra),
                core=0,
                max_model_len=max_model_len,
                log_dir=log_dir,
            )
        )
        self.d = VllmServer(
            ServerSpec(
                "decode",
                model,
                kv_config=kvpush_config("kv_consumer", "decode", free_port(), **extra),
                core=1,
                max_model_len=max_model_len,
                log_dir=log_dir,
                extra_args=list(decode_args or ()),
            )
        )
        self.router = RouterProc(
            self.p.url, self.d.url, f"127.0.0.1:{self.side_port}", log_dir, extra=router_args
        )

    def __enter__(self) -> Cluster:
        try:
            wait_healthy([self.p, self.d, self.router])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in (self.router, self.d, self.p):
            proc.stop()


def run_batch(
    url: str, model: str, prompts: list[str], opts: VllmDemoOptions, stream: bool
) -> list[Reply]:
    with ThreadPoolExecutor(opts.concurrency) as pool:
        return list(
            pool.map(
                lambda p: request(url, model, p, max_tokens=opts.max_tokens, stream=stream), prompts
            )
        )


def run_vllm_demo(opts: VllmDemoOptions, log: Any = print) -> dict[str, Any]:
    model = ensure_model(opts.model or default_model_dir())
    workdir = opts.workdir or tempfile.mkdtemp(prefix="kvpush-demo-")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    prompts = make_prompts(opts.requests, opts.seed)
    log(f"starting prefiller, decoder and router (logs in {workdir}) ...")
    with Cluster(model, workdir) as c:
        # One warm-up request: the first push pays both handshakes and NIXL's connection set-up.
        warm = request(c.router.url, model, prompts[0], max_tokens=1)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        log(
            f"router at {c.router.url}; sending {len(prompts)} prompts, "
            f"{opts.concurrency} at a time, both legs at once"
        )
        pushed0 = metric(c.d.url, "vllm:kvpush_bytes_received_total")
        received0 = metric(c.d.url, "vllm:kvpush_pushes_received_total")
        replies = run_batch(c.router.url, model, prompts, opts, stream=True)
        pushed = metric(c.d.url, "vllm:kvpush_bytes_received_total") - pushed0
        received = metric(c.d.url, "vllm:kvpush_pushes_received_total") - received0
    summary: dict[str, Any] = {
        "requests": len(prompts),
        "completed": sum(r.ok for r in replies),
        "pushed_bytes": int(pushed),
        "pushes_received": int(received),
        "ttft_ms_p50": _pct([r.ttft_s * 1e3 for r in replies if r.ok], 50),
        "ttft_ms_p90": _pct([r.ttft_s * 1e3 for r in replies if r.ok], 90),
        "e2e_ms_p50": _pct([r.total_s * 1e3 for r in replies if r.ok], 50),
        "logs": workdir,
    }
    total_blocks = sum(-(-r.prompt_tokens // 128) for r in replies if r.ok) or 1
    per_block = pushed / total_blocks
    summary["per_request"] = [
        {
            "prompt_tokens": r.prompt_tokens,
            "ttft_ms": round(r.ttft_s * 1e3, 1),
            "pushed_bytes": int(-(-r.prompt_tokens // 128) * per_block),
            "ok": r.ok,
            "text": r.text,
            "error": r.error,
        }
        for r in replies
    ]
    if opts.check:
        log("starting one plain vLLM server for the comparison ...")
        plain = VllmServer(ServerSpec("plain", model, core=0, log_dir=workdir))
        try:
            wait_healthy([plain])
            reference = run_batch(plain.url, model, prompts, opts, stream=False)
        finally:
            plain.stop()
        summary["matched"] = sum(
            a.ok and b.ok and _same(a, b) for a, b in zip(replies, reference, strict=True)
        )
    return summary


def _same(a: Reply, b: Reply) -> bool:
    if a.token_ids and b.token_ids:
        return a.token_ids == b.token_ids
    return a.text == b.text


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else 0.0


def render(s: dict[str, Any]) -> str:
    lines = [
        f"kvpush demo: {s['completed']}/{s['requests']} requests through the router "
        f"(prefill and decode legs sent at once)"
    ]
    for i, r in enumerate(s["per_request"]):
        state = "ok " if r["ok"] else "ERR"
        lines.append(
            f"  #{i:<2} {state} prompt {r['prompt_tokens']:>4} tok  "
            f"ttft {r['ttft_ms']:>7.1f} ms  pushed {r['pushed_bytes'] / 1024:>6.0f} KiB  "
            f"{(r['text'] if r['ok'] else r['error'])[:40]!r}"
        )
    lines.append(
        f"  KV pushed into the decoder: {s['pushed_bytes'] / 2**20:.2f} MiB in "
        f"{s['pushes_received']} pushes; TTFT p50 {s['ttft_ms_p50']} ms, "
        f"p90 {s['ttft_ms_p90']} ms"
    )
    if "matched" in s:
        lines.append(f"  identical to a plain vLLM server: {s['matched']}/{s['requests']}")
    return "\n".join(lines)
