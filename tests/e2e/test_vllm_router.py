"""kvpush behind the real vllm-router (PyPI `vllm-router`): two kvpush prefillers and one
kvpush decoder, real vLLM servers on CPU, against one plain server.

vllm-router sends the prefill leg, waits for P's answer and sends the decode leg with the
`kv_transfer_params` P returned (P's side channel and the key P minted), the same
`X-Request-Id` on both legs. Nothing kvpush-specific is configured in the router. P2 and D
share a core (as in the other e2e modules): while P waits for D's registration both engines
step without tokens, which once starved P for its whole lease (worker_side.IDLE_SLEEP_S).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpush.deploy.client import Reply, request
from kvpush.deploy.servers import (
    Proc,
    ServerSpec,
    VllmServer,
    free_port,
    kvpush_config,
    metric,
    wait_healthy,
)
from kvpush.tiny_model import make_tiny_model
from tests.conftest import wait_no_kv_in_use, wait_until

pytestmark = pytest.mark.e2e

SENT = "vllm:kvpush_pushes_sent_total"
RECEIVED = "vllm:kvpush_pushes_received_total"
PROMPTS = [f"the {w} river runs past the silver moon and the old mill " * 3 for w in
           ("north", "south", "east", "west", "slow", "quiet", "long", "cold")]  # fmt: skip


class VllmRouter(Proc):
    """The vllm-router binary in PD mode over the given prefillers and decoder."""

    def __init__(self, prefill: list[str], decode: str, log_dir: str) -> None:
        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        assert exe, "vllm-router is not installed (pyproject's test extra)"
        self.port = free_port()
        argv = [exe, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(self.port)]
        for url in prefill:
            argv += ["--prefill", url]
        argv += ["--decode", decode, "--prefill-policy", "round_robin"]
        argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "2"]
        # Its metrics exporter would take 29000, inside free_port's range (20000-32000): a
        # port handed to one of this run's servers would stop the router at start-up.
        argv += ["--prometheus-port", str(free_port())]
        super().__init__("vllm-router", argv, dict(os.environ), Path(log_dir) / "vllm-router.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = str(tmp_path_factory.mktemp("vllm-router"))
    model = make_tiny_model(str(Path(work) / "model"))

    def server(name: str, kv: dict[str, Any] | None, core: int) -> VllmServer:
        return VllmServer(ServerSpec(name, model, kv_config=kv, core=core, log_dir=work))

    plain = server("plain", None, 0)
    p1 = server("prefill-1", kvpush_config("kv_producer", "prefill-1", free_port()), 0)
    p2 = server("prefill-2", kvpush_config("kv_producer", "prefill-2", free_port()), 1)
    d = server("decode", kvpush_config("kv_consumer", "decode", free_port()), 1)
    procs: list[Proc] = [plain, p1, p2, d]
    try:
        wait_healthy(procs)
        router = VllmRouter([p1.url, p2.url], d.url, work)
        procs.append(router)
        wait_healthy([router], 120)  # it listens once every worker answered its health check
        reference = {p: send(plain.url, model, p) for p in PROMPTS}
        yield {"model": model, "p1": p1, "p2": p2, "d": d, "router": router, "ref": reference}
    finally:
        for proc in reversed(procs):
            proc.stop()


def send(url: str, model: str, prompt: str) -> Reply:
    return request(url, model, prompt, max_tokens=8, timeout=60)


def test_token_identical_and_both_prefillers_used(env: dict[str, Any]) -> None:
    p1, p2, d = env["p1"], env["p2"], env["d"]
    before = [metric(s.url, SENT) for s in (p1, p2)] + [metric(d.url, RECEIVED)]
    for prompt in PROMPTS:
        got, ref = send(env["router"].url, env["model"], prompt), env["ref"][prompt]
        assert got.ok and ref.ok, (got.error, ref.error)
        assert got.token_ids == ref.token_ids, (got.text, ref.text)

    def sent() -> list[float]:
        return [metric(s.url, SENT) - b for s, b in zip((p1, p2), before, strict=False)]

    # P's counters reach its /metrics with the engine's next stats, a moment after D's
    # answer: wait for the last ones rather than read once.
    wait_until(lambda: sum(sent()) >= len(PROMPTS), 10, what="P's push counters")
    assert min(sent()) >= 1 and sum(sent()) == len(PROMPTS), sent()  # round robin: both pushed
    assert metric(d.url, RECEIVED) - before[2] == len(PROMPTS)  # every KV came by push


def test_nothing_held_afterwards(env: dict[str, Any]) -> None:
    servers = (env["p1"], env["p2"], env["d"])
    wait_no_kv_in_use(servers)
    assert sum(metric(s.url, "vllm:kvpush_push_failures_total") for s in servers) == 0


def test_a_killed_prefiller_fails_requests_cleanly_and_is_taken_out(env: dict[str, Any]) -> None:
    """Last: it kills P2. Requests routed to it fail with an error status, none hangs;
    once vllm-router's health check has taken P2 out, every request succeeds via P1."""
    env["p2"].kill()
    url, model = env["router"].url, env["model"]
    deadline = time.monotonic() + 60
    streak = 0
    while streak < 4:  # four in a row through the survivor: P2 is out of the rotation
        assert time.monotonic() < deadline, "vllm-router kept routing to the dead prefiller"
        t0 = time.monotonic()
        got = send(url, model, PROMPTS[streak])
        assert time.monotonic() - t0 < 20, f"a request took {time.monotonic() - t0:.1f}s"
        if got.ok:
            assert got.token_ids == env["ref"][PROMPTS[streak]].token_ids
            streak += 1
        else:
            assert got.status >= 500, got  # an error status, never a wrong answer
            streak = 0
    wait_no_kv_in_use((env["p1"], env["d"]))
