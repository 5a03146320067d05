"""The layer-wise push across the test hosts' link (tests/e2e/hosts.py: network
namespaces, private /dev/shm, UCX on TCP over one veth), slowed to 100 Mbit/s so the
layers' WRITEs are still on the link while P computes: outputs token-identical to a
plain server, chunked prompts included, every layer's KV across the link, nothing failed
or held afterwards. Needs root (CI runs as root)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.deploy.servers import (
    RouterProc,
    ServerSpec,
    VllmServer,
    free_port,
    kvpush_config,
    metric,
    wait_healthy,
)
from kvpush.tiny_model import make_tiny_model
from tests.conftest import plain_reference, wait_until
from tests.e2e.hosts import HostPair
from tests.e2e.test_cross_host import (
    BLOCK,
    BYTES_PER_BLOCK,
    FAILURES,
    LEASE,
    RECEIVED,
    WATCHDOG,
    Case,
    ids,
    same,
    server,
    side_port,
)

pytestmark = pytest.mark.e2e

CHUNK = 256  # P's --max-num-batched-tokens
LAYER_WRITES = "vllm:kvpush_layer_writes_total"
CASES = [
    Case("prompt_60", ids(60, 1)),
    Case("prompt_300_two_chunks", ids(300, 2)),
    Case("prompt_450_streamed", ids(450, 3), stream=True, max_tokens=12),
]


def prefiller(model: str, hosts: HostPair, work: str) -> VllmServer:
    """P on its test host, every prompt layer by layer, prompts over CHUNK chunked."""
    config = kvpush_config(
        "kv_producer", "prefill", free_port(), side_channel_host=hosts.p.link,
        lease_s=LEASE, watchdog_s=WATCHDOG, layerwise_min_tokens=1,
    )  # fmt: skip
    spec = ServerSpec(
        "prefill", model, kv_config=config, core=0, env=hosts.env(), log_dir=work,
        host=hosts.p.front, prefix=hosts.p.prefix(), max_num_batched_tokens=CHUNK,
    )  # fmt: skip
    return VllmServer(spec)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = str(tmp_path_factory.mktemp("layerwise_cross_host"))
    model = make_tiny_model(work + "/model")
    with HostPair(prefix="kvw", net=79, tcp_retries2=3) as hosts:
        p = prefiller(model, hosts, work)
        d = server("decode", model, "kv_consumer", hosts, work, 1)
        plain = VllmServer(ServerSpec("plain", model, core=1, log_dir=work))
        router = RouterProc(p.url, d.url, f"{hosts.p.link}:{side_port(p)}", work)
        try:
            reference = plain_reference(plain, model, CASES)
            hosts.limit("100mbit")
            wait_healthy([p, d, router])
            yield {"model": model, "hosts": hosts, "p": p, "d": d, "router": router,
                   "reference": reference}  # fmt: skip
        finally:
            plain.stop()
            for proc in (router, d, p):
                proc.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_identical_layer_by_layer_across_the_link(env: dict[str, Any], case: Case) -> None:
    p, d = env["p"], env["d"]
    got, writes = metric(d.url, RECEIVED), metric(p.url, LAYER_WRITES)
    wire = env["hosts"].p.link_counter()
    reply = case.send(env["router"].url, env["model"])
    assert same(reply, env["reference"][case.name]), (case.name, reply.error, reply.text)
    kv = -(-reply.prompt_tokens // BLOCK) * BYTES_PER_BLOCK
    assert metric(d.url, RECEIVED) - got == kv
    assert env["hosts"].p.link_counter() - wire >= kv  # over the veth, nothing else
    chunks = -(-reply.prompt_tokens // CHUNK)
    wait_until(
        lambda: metric(p.url, LAYER_WRITES) - writes == 2 * chunks, 10,
        lambda: time.sleep(0.1), "a WRITE per layer and chunk",
    )  # fmt: skip


def test_nothing_failed_or_unreported(env: dict[str, Any]) -> None:
    p, d = env["p"], env["d"]
    assert metric(p.url, FAILURES) == metric(d.url, FAILURES) == 0
    assert metric(p.url, "vllm:kvpush_layers_unreported_total") == 0
    assert metric(p.url, LAYER_WRITES) > 0
