"""The router over two kvpush prefillers and two decoders (real vLLM CPU servers, tiny
model): both of each serve; then, mid-run, one prefiller is killed and one decoder drained.
No request hangs, every client sees a success or a clear error, traffic moves to the
survivors, and afterwards no server holds a block.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvpush.deploy.client import Reply, request
from kvpush.deploy.pools import PoolCluster
from kvpush.deploy.servers import metric
from kvpush.router.pool import InstanceSpec, Policy, Pool, affinity_key
from kvpush.tiny_model import make_tiny_model
from tests.conftest import wait_no_kv_in_use, wait_until

pytestmark = pytest.mark.e2e

RECEIVED = "vllm:kvpush_pushes_received_total"
SENT = "vllm:kvpush_pushes_sent_total"
TIMEOUT = 60.0  # per client request: far above a healthy one, a hang fails it
ROUTER_ARGS = ["--health-interval", "0.5", "--health-timeout", "5", "--retries", "2"]
ROUTER_ARGS += ["--admin-loopback-without-token"]  # admin() sends no token


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("router-pools")
    model = make_tiny_model(str(work / "model"))
    with PoolCluster(model, str(work), 2, 2, router_args=ROUTER_ARGS) as cluster:
        warm_up(cluster, model)
        yield {"model": model, "c": cluster}


def warm_up(c: PoolCluster, model: str) -> None:
    """One request per (P, D) pair, one at a time (the other decoder drained meanwhile):
    each pair's first push pays its handshakes outside the measured runs."""
    by_p = prompts_for(c, 1)
    for d in c.ds:
        others = [o for o in c.ds if o is not d]
        for o in others:
            admin(c, "/admin/drain", {"role": "decode", "url": o.url, "drain": True})
        for p in c.ps:
            reply = request(c.router.url, model, by_p[p.url][0], max_tokens=2, timeout=TIMEOUT)
            assert reply.ok, reply.error
        for o in others:
            admin(c, "/admin/drain", {"role": "decode", "url": o.url, "drain": False})


def prompts_for(c: PoolCluster, n: int) -> dict[str, list[str]]:
    """`n` prompts per prefiller URL that its prefix affinity sends there (a pool with
    nothing learnt ranks by the hash alone, as the router's does while all are idle)."""
    pool = Pool(Policy())
    for p in c.ps:
        pool.add(InstanceSpec("prefill", p.url))
    out: dict[str, list[str]] = {p.url: [] for p in c.ps}
    i = 0
    while any(len(v) < n for v in out.values()):
        prompt = f"request {i}: the quick brown fox jumps over the lazy dog " * 3
        inst = pool.choose("prefill", affinity_key({"prompt": prompt}, False, 256))
        assert inst is not None
        if len(out[inst.url]) < n:
            out[inst.url].append(prompt)
        i += 1
    return out


def send_all(c: PoolCluster, model: str, prompts: list[str], workers: int = 4) -> list[Reply]:
    def one(k: int) -> Reply:
        return request(
            c.router.url, model, prompts[k], max_tokens=12, stream=k % 2 == 0, timeout=TIMEOUT
        )

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(prompts))))


def admin(c: PoolCluster, path: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(c.router.url + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def counts(c: PoolCluster) -> dict[str, float]:
    live = [s for s in c.servers() if s.alive()]
    return {s.name: metric(s.url, SENT if s in c.ps else RECEIVED) for s in live}


def test_both_prefillers_and_both_decoders_serve(env: dict[str, Any]) -> None:
    c: PoolCluster = env["c"]
    by_p = prompts_for(c, 3)
    # Every instance usable in the router's view first: under load a health probe can
    # time out, and the router then rightly sends the prompts elsewhere.
    wait_until(
        lambda: all(i["available"] for i in admin(c, "/admin/instances")["instances"]),
        30,
        lambda: time.sleep(0.2),
        "every instance available",
    )
    before = counts(c)
    replies = send_all(c, env["model"], [q for qs in by_p.values() for q in qs])
    assert all(r.ok for r in replies), [r.error for r in replies if not r.ok]

    def all_counted() -> bool:
        now = counts(c)
        return all(
            sum(now[s.name] - before[s.name] for s in side) >= len(replies) for side in (c.ds, c.ps)
        )

    # Each side's counters reach vLLM's metrics at its own engine's next step: a client's
    # reply can come before a busy prefiller has reported its WRITE done.
    wait_until(
        all_counted,
        20,
        lambda: time.sleep(0.2),
        "every request's push sent and received",
    )
    after = counts(c)
    listing = admin(c, "/admin/instances")["instances"]
    for s in c.servers():
        assert after[s.name] > before[s.name], (
            f"{s.name} took no part: {before} -> {after}; the router's view: {listing}"
        )


def test_killed_prefiller_and_drained_decoder_mid_run(env: dict[str, Any]) -> None:
    c: PoolCluster = env["c"]
    model = env["model"]
    victim, drained = c.ps[1], c.ds[1]
    by_p = prompts_for(c, 8)
    # Half of the prompts belong to the prefiller that dies.
    mixed = [q for pair in zip(*by_p.values(), strict=True) for q in pair]

    def received() -> float:
        return sum(metric(d.url, RECEIVED) for d in c.ds)

    before = received()
    with ThreadPoolExecutor(1) as bg:
        run = bg.submit(send_all, c, model, mixed, 4)
        wait_until(
            lambda: received() - before >= 2, 60, lambda: time.sleep(0.05), "the run under way"
        )
        victim.kill()
        listing = admin(c, "/admin/drain", {"role": "decode", "url": drained.url})
        assert listing["draining"] is True
        started = time.monotonic()
        replies = run.result(timeout=len(mixed) * TIMEOUT)
    assert time.monotonic() - started < 2 * TIMEOUT
    for r in replies:
        # A success, or a clear error: an error status with the router's error object,
        # or an in-stream error event naming the leg (never a timeout: nothing hung).
        assert r.ok or r.status in (502, 503, 504) or "'leg'" in r.error, r
    assert sum(r.ok for r in replies) >= len(replies) // 2, [r.error for r in replies]
    # Traffic has moved: new requests, also those whose prefix the dead prefiller had,
    # succeed on the survivors; the drained decoder gets none.
    wait_until(
        lambda: not _instance(c, "prefill", victim.url)["healthy"],
        10,
        lambda: time.sleep(0.1),
        "the dead prefiller out",
    )
    got = metric(drained.url, RECEIVED)
    later = send_all(c, model, by_p[victim.url][:4] + by_p[c.ps[0].url][:4])
    assert all(r.ok for r in later), [r.error for r in later if not r.ok]
    assert metric(drained.url, RECEIVED) == got
    assert _instance(c, "decode", drained.url)["in_flight"] == 0
    # Nobody alive holds a block (the killed prefiller's pushes failed or were withdrawn).
    wait_no_kv_in_use([c.ps[0], *c.ds], timeout=45)


def _instance(c: PoolCluster, role: str, url: str) -> dict[str, Any]:
    listing = admin(c, "/admin/instances")["instances"]
    return next(i for i in listing if i["role"] == role and i["url"] == url)
