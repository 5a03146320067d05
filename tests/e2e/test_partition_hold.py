"""A partition with the kernel's TCP defaults: D fails the requests cut mid-push at its
watchdog but keeps their blocks for ``late_write_hold_s``, because bytes P's TCP
connection still holds can land once the link heals (kvpush/core/late_writes.py).

Test hosts as in test_cross_host.py, but ``tcp_retries2`` left at the kernel's 15 (a cut
connection survives about 15 minutes), and D's hold set to HOLD instead of that.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpush.deploy.servers import RouterProc, ServerSpec, VllmServer, metric, wait_healthy
from kvpush.tiny_model import make_tiny_model
from tests.conftest import plain_reference, wait_until
from tests.e2e.hosts import HostPair
from tests.e2e.test_cross_host import (
    AFTER,
    IN_FLIGHT,
    LEASE,
    ROUTER_TIMEOUT,
    SINGLE,
    WATCHDOG,
    Env,
    cut_mid_push,
    same,
    server,
    side_port,
)

pytestmark = pytest.mark.e2e
# Long enough for a retransmission after the link is back (TCP's backoff doubles from
# 0.2 s: one comes 6.2, 12.6 and 25.4 s into an outage), short enough for CI.
HOLD = 30.0
HOLDS = "vllm:kvpush_late_write_holds_total"
LATE = "vllm:kvpush_late_completions_held_total"
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = str(tmp_path_factory.mktemp("partition_hold"))
    model = make_tiny_model(work + "/model")
    with HostPair(prefix="kvh", net=78) as hosts:
        p = server("prefill", model, "kv_producer", hosts, work, 0)
        d = server("decode", model, "kv_consumer", hosts, work, 1, late_write_hold_s=HOLD)
        plain = VllmServer(ServerSpec("plain", model, core=1, log_dir=work))
        side = f"{hosts.p.link}:{side_port(p)}"
        router = RouterProc(p.url, d.url, side, work, extra=["--timeout", str(ROUTER_TIMEOUT)])
        procs = [router, d, p]
        try:
            reference = plain_reference(plain, model, SINGLE[:2] + AFTER)
            wait_healthy([p, d, router])
            yield Env(model, hosts, p, d, router, reference)
        finally:
            plain.stop()
            for proc in procs:
                proc.stop()


def test_cut_mid_push_d_holds_its_blocks_until_the_hold_ends(env: Env) -> None:
    assert SINGLE[1].send(env.router.url, env.model).ok  # connections up before the cut
    holds = metric(env.d.url, HOLDS)
    replies, cut = cut_mid_push(env)
    try:
        assert all(r.status == 502 and "decode leg" in r.error for r in replies), [
            (r.status, r.error) for r in replies
        ]
        assert time.monotonic() - cut < WATCHDOG + 6
        # The clients have their errors; P frees at its lease (it disconnects the silent D).
        wait_until(lambda: metric(env.p.url, USAGE) == 0.0, LEASE + 6, what="P to free")
        # D cannot tell P's WRITEs are gone: the connection may still deliver them.
        assert metric(env.d.url, HOLDS) - holds == len(IN_FLIGHT)
        assert metric(env.d.url, USAGE) > 0.0
    finally:
        env.hosts.link_up()
        up = time.monotonic()
    # Back: new requests succeed, token-identical, in blocks no late byte can reach.
    for case in AFTER:
        reply = case.send(env.router.url, env.model)
        assert same(reply, env.reference[case.name]), (case.name, reply.status, reply.error)
    # The hold ends and D frees the blocks without any new request.
    wait_until(lambda: metric(env.d.url, USAGE) == 0.0, HOLD + 10, what="D to free after its hold")
    freed = time.monotonic() - cut
    print(f"D freed {freed:.1f} s after the cut ({time.monotonic() - up:.1f} s after link up); "
          f"late completions into held blocks: {metric(env.d.url, LATE):g}")  # fmt: skip
    assert freed > HOLD - WATCHDOG  # not before the hold: it began at D's watchdog
