"""P and D on different test hosts (tests/e2e/hosts.py: network namespaces, private
/dev/shm, UCX on TCP over one veth link), the router in the root namespace: outputs
identical to a plain server, the KV crossing the link, and faults on the link (cut
mid-transfer and restored, rate-limited under a burst). Needs root (CI runs as root)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

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
from kvpush.tiny_model import make_tiny_model
from tests.conftest import plain_reference, wait_until
from tests.e2e.hosts import HostPair

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size
BYTES_PER_BLOCK = 2 * 64 * 1024  # tiny model: 2 layers x one 64 KiB block each
LEASE = WATCHDOG = 4.0
ROUTER_TIMEOUT = 20.0
SENT, RECEIVED = "vllm:kvpush_bytes_sent_total", "vllm:kvpush_bytes_received_total"
FAILURES = "vllm:kvpush_push_failures_total"


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 20 for i in range(n)]


@dataclass
class Case:
    name: str
    prompt: Any = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    max_tokens: int = 8

    def send(self, url: str, model: str, timeout: float = 60.0) -> Reply:
        return request(
            url, model, self.prompt, self.messages, self.max_tokens, self.stream, timeout
        )


SINGLE = [
    Case("prompt_60", ids(60, 1)),
    Case("prompt_450", ids(450, 2)),
    Case("streamed_300", ids(300, 3), stream=True, max_tokens=12),
    Case("chat", messages=[{"role": "user", "content": "silver moons over quiet rivers"}]),
]
BURST = [Case(f"burst_{i}", ids(60 + 37 * i, 10 + i)) for i in range(12)]
AFTER = [Case(f"after_{i}", ids(200 + 50 * i, 30 + i)) for i in range(3)]
IN_FLIGHT = [ids(450, 50 + i) for i in range(3)]


@dataclass
class Env:
    model: str
    hosts: HostPair
    p: VllmServer
    d: VllmServer
    router: RouterProc
    reference: dict[str, Reply]


def server(
    name: str, model: str, role: str, hosts: HostPair, work: str, core: int, **extra: Any
) -> VllmServer:
    host = hosts.p if role == "kv_producer" else hosts.d
    config = kvpush_config(
        role,
        name,
        free_port(),
        side_channel_host=host.link,
        lease_s=LEASE,
        watchdog_s=WATCHDOG,
        handshake_timeout_s=3.0,
        heartbeat_interval_s=0.5,
        **extra,
    )
    spec = ServerSpec(
        name, model, kv_config=config, core=core, env=hosts.env(), log_dir=work,
        host=host.front, prefix=host.prefix(),
    )  # fmt: skip
    return VllmServer(spec)


def side_port(server: VllmServer) -> int:
    assert server.spec.kv_config is not None
    return int(server.spec.kv_config["kv_connector_extra_config"]["side_channel_port"])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = str(tmp_path_factory.mktemp("cross_host"))
    model = make_tiny_model(work + "/model")
    # tcp_retries2=3: the kernel gives a cut connection up after about 3 s, < WATCHDOG, so
    # nothing sent before a cut can land later and D's cancel fails at once: D frees its
    # blocks at its watchdog. test_partition_hold.py cuts with the kernel's default (15),
    # where D keeps them for late_write_hold_s.
    with HostPair(tcp_retries2=3) as hosts:
        p = server("prefill", model, "kv_producer", hosts, work, 0)
        d = server("decode", model, "kv_consumer", hosts, work, 1)
        plain = VllmServer(ServerSpec("plain", model, core=1, log_dir=work))
        side = f"{hosts.p.link}:{side_port(p)}"
        router = RouterProc(p.url, d.url, side, work, extra=["--timeout", str(ROUTER_TIMEOUT)])
        procs = [router, d, p]
        try:
            reference = plain_reference(plain, model, SINGLE + BURST + AFTER)
            wait_healthy([p, d, router])
            yield Env(model, hosts, p, d, router, reference)
        finally:
            plain.stop()
            for proc in procs:
                proc.stop()


def same(a: Reply, b: Reply) -> bool:
    return a.ok and b.ok and (a.token_ids == b.token_ids if a.token_ids else a.text == b.text)


def blocks_of(prompt_tokens: int) -> int:
    return -(-prompt_tokens // BLOCK)


def nothing_held(e: Env, within: float) -> None:
    def free() -> bool:
        return all(metric(s.url, "vllm:kv_cache_usage_perc") == 0.0 for s in (e.p, e.d))

    wait_until(free, within, lambda: time.sleep(0.2), "P and D to hold no KV blocks")


def test_identical_across_the_link_and_bytes_counted(env: Env) -> None:
    for case in SINGLE:
        sent, got = metric(env.p.url, SENT), metric(env.d.url, RECEIVED)
        wire = env.hosts.p.link_counter()
        reply = case.send(env.router.url, env.model)
        assert same(reply, env.reference[case.name]), (case.name, reply.error, reply.text)
        kv = blocks_of(reply.prompt_tokens) * BYTES_PER_BLOCK
        # Counted on both sides (P counts once its WRITE completed: poll for it).
        wait_until(lambda: metric(env.p.url, SENT) - sent == kv, 10, what=f"P's {kv} bytes")  # noqa: B023
        assert metric(env.d.url, RECEIVED) - got == kv
        # ... and it crossed the veth: no shared-memory or same-host path took it.
        assert env.hosts.p.link_counter() - wire >= kv
    nothing_held(env, 10)
    assert metric(env.p.url, FAILURES) == metric(env.d.url, FAILURES) == 0


def test_slow_link_burst(env: Env) -> None:
    env.hosts.limit("100mbit")
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(len(BURST)) as pool:
            replies = list(pool.map(lambda c: c.send(env.router.url, env.model, 60), BURST))
        took = time.monotonic() - started
    finally:
        env.hosts.unlimit()
    for case, reply in zip(BURST, replies, strict=True):
        assert same(reply, env.reference[case.name]), (case.name, reply.status, reply.error)
    assert took < ROUTER_TIMEOUT, took
    nothing_held(env, LEASE + 5)


def cut_mid_push(env: Env) -> tuple[list[Reply], float]:
    """Send IN_FLIGHT through the router over a slow link and take the link down while
    their WRITEs are on it; returns the replies and when the link went down (the link
    stays down, its rate limit is lifted)."""
    # A slow link keeps the WRITEs in flight (512 KiB per request at 2 Mbit/s: ~2 s each).
    env.hosts.limit("2mbit", burst="8kb")
    wire = env.hosts.p.link_counter()
    with ThreadPoolExecutor(len(IN_FLIGHT)) as pool:
        futures = [
            pool.submit(request, env.router.url, env.model, prompt, max_tokens=4, timeout=60)
            for prompt in IN_FLIGHT
        ]
        # Cut once KV is on the wire (well short of one request's 512 KiB).
        wait_until(
            lambda: env.hosts.p.link_counter() - wire > 64 * 1024, 30, lambda: time.sleep(0.01),
            "KV bytes on the link",
        )  # fmt: skip
        env.hosts.link_down()
        cut = time.monotonic()
        replies = [f.result() for f in futures]
    env.hosts.unlimit()
    return replies, cut


def test_link_cut_mid_transfer_and_restored(env: Env) -> None:
    assert SINGLE[1].send(env.router.url, env.model).ok  # connections up before the cut
    p_failures = metric(env.p.url, FAILURES)
    replies, cut = cut_mid_push(env)
    failed_within = time.monotonic() - cut
    try:
        # D's watchdog fails them: the router answers 502 with D's error, within the watchdog.
        assert all(r.status == 502 and "decode leg" in r.error for r in replies), [
            (r.status, r.error) for r in replies
        ]
        assert failed_within < WATCHDOG + 6, failed_within
        # Both sides free their blocks while the link is still down: P's lease runs out
        # under the posted WRITEs, it disconnects the silent D and the WRITEs end in error.
        nothing_held(env, LEASE + 6)
        assert metric(env.p.url, FAILURES) - p_failures == len(IN_FLIGHT)
    finally:
        env.hosts.link_up()
    # Back: new requests succeed, token-identical, without restarting anything. (With
    # tcp_retries2=3 no bytes from before the cut arrive late.)
    for case in AFTER:
        reply = case.send(env.router.url, env.model)
        assert same(reply, env.reference[case.name]), (case.name, reply.status, reply.error)
    nothing_held(env, LEASE + 5)
