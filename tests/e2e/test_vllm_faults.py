"""Killing a vLLM server mid-request: the client gets an error promptly, the survivor frees
its blocks within the lease or watchdog and serves new requests once the peer is back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.deploy.client import Reply, request
from kvpush.deploy.demo import Cluster
from kvpush.deploy.servers import VllmServer, metric, wait_healthy
from kvpush.tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e

LEASE = WATCHDOG = 4.0
HANDSHAKE = 3.0
ROUTER_TIMEOUT = 20.0
PROMPT = [(i * 7919) % 900 + 20 for i in range(300)]
LONG = 1700  # tokens D decodes in the request it is killed in (the model allows 2048)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    work = tmp_path_factory.mktemp("faults")
    model = make_tiny_model(str(work / "model"))
    with Cluster(
        model,
        str(work),
        router_args=["--timeout", str(ROUTER_TIMEOUT)],
        max_model_len=2048,
        lease_s=LEASE,
        watchdog_s=WATCHDOG,
        handshake_timeout_s=HANDSHAKE,
        heartbeat_interval_s=0.5,
    ) as c:
        yield c, model


def usage_zero(server: VllmServer, within: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within:
        if metric(server.url, "vllm:kv_cache_usage_perc") == 0.0:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{server.name} still holds KV blocks after {within}s")


def restart(old: VllmServer) -> VllmServer:
    new = VllmServer(old.spec)  # same ports, new process (a new NIXL agent)
    wait_healthy([new])
    return new


def in_background(fn: Any) -> tuple[threading.Thread, list[Reply]]:
    out: list[Reply] = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    return th, out


def test_decoder_killed_mid_request(cluster: tuple[Cluster, str]) -> None:
    c, model = cluster
    assert request(c.router.url, model, PROMPT, max_tokens=4).ok  # warm: both handshakes done
    decoding = threading.Event()
    th, out = in_background(
        lambda: request(
            c.router.url,
            model,
            PROMPT,
            max_tokens=LONG,
            stream=True,
            timeout=60,
            extra={"ignore_eos": True},
            first_token=decoding,
        )
    )
    # The client's first token is D's first chunk: D holds the request and has LONG - 1
    # tokens to go. (Polling D's running/waiting gauges instead missed the window on a
    # loaded CI machine: the whole request can end between two scrapes.)
    assert decoding.wait(30), f"no first token from the decoder: {out}"
    killed = time.monotonic()
    c.d.kill()
    th.join(ROUTER_TIMEOUT + 10)
    assert out and not out[0].ok, "the client must see an error, not a truncated success"
    assert time.monotonic() - killed < ROUTER_TIMEOUT + 5
    # A prefill whose decoder is gone: P frees its blocks within the lease.
    th, out = in_background(lambda: request(c.router.url, model, PROMPT, max_tokens=4, timeout=30))
    th.join(ROUTER_TIMEOUT + 10)
    assert out and not out[0].ok
    assert usage_zero(c.p, LEASE + 10) <= LEASE + 10
    c.d = restart(c.d)
    reply = request(c.router.url, model, PROMPT, max_tokens=4)
    assert reply.ok, reply.error
    assert metric(c.d.url, "vllm:kvpush_bytes_received_total") > 0


def test_prefiller_killed(cluster: tuple[Cluster, str]) -> None:
    c, model = cluster
    assert request(c.router.url, model, PROMPT, max_tokens=4).ok
    c.p.kill()
    # Through the router: the prefill leg fails, the client gets a clear error at once.
    started = time.monotonic()
    reply = request(c.router.url, model, PROMPT, max_tokens=4, timeout=60)
    assert not reply.ok and reply.status in (502, 504), (reply.status, reply.error)
    assert time.monotonic() - started < ROUTER_TIMEOUT + 5
    # Straight to the decoder: it fails within its handshake timeout / watchdog.
    params = {
        "do_remote_prefill": True,
        "transfer_id": "orphan",
        "remote_host": "127.0.0.1",
        "remote_port": c.side_port,
    }
    started = time.monotonic()
    reply = request(
        c.d.url, model, PROMPT, max_tokens=4, timeout=60, extra={"kv_transfer_params": params}
    )
    assert not reply.ok
    assert time.monotonic() - started < max(HANDSHAKE, WATCHDOG) + 10
    assert usage_zero(c.d, WATCHDOG + 10) <= WATCHDOG + 10
    c.p = restart(c.p)
    reply = request(c.router.url, model, PROMPT, max_tokens=4)
    assert reply.ok, reply.error
