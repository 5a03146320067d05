"""A client's own kv_transfer_params sent straight to a kvpush decoder (issue 37): whatever
they name, that request fails fast and alone, and D keeps serving (real P, D and router).

A plain vLLM server ignores kv_transfer_params (no connector) and answers 200. A kvpush D
fails such a request as vLLM fails a KV load under kv_load_failure_policy "fail": HTTP 500
"Internal server error", the cause in D's log ("invalid kv_transfer_params: ...").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.deploy.client import Reply, request
from kvpush.deploy.demo import Cluster
from kvpush.tiny_model import make_tiny_model
from tests.conftest import wait_no_kv_in_use

pytestmark = pytest.mark.e2e

HANDSHAKE = 2.0  # handshake_timeout_s: a dead address costs its requests this long
PROMPT = [(i * 7919) % 900 + 20 for i in range(100)]
ISSUE = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9}
HOSTILE: dict[str, dict[str, Any]] = {
    # The issue's request: eight P ranks at ports where nobody listens.
    "dead_ranks": {**ISSUE, "remote_tp_size": 8},
    # Before: rank arithmetic quadratic in it (the engine never answered again).
    "huge_tp": {**ISSUE, "remote_tp_size": 100_000},
    "huge_pp": {**ISSUE, "remote_tp_size": 8, "remote_pp_size": 5000},
    "nested_host": {**ISSUE, "remote_host": {"a": [1, {"b": 2}]}},
    "port_as_text": {**ISSUE, "remote_port": "9"},
    "bool_port": {**ISSUE, "remote_port": True},
    "zmq_wildcard": {**ISSUE, "remote_host": "*"},
    "many_keys": {**ISSUE, **{f"k{i}": i for i in range(500)}},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    work = tmp_path_factory.mktemp("untrusted")
    model = make_tiny_model(str(work / "model"))
    with Cluster(model, str(work), handshake_timeout_s=HANDSHAKE, max_model_len=512) as c:
        yield c, model


def hostile(c: Cluster, model: str, params: dict[str, Any]) -> tuple[Reply, float]:
    started = time.monotonic()
    reply = request(
        c.d.url, model, PROMPT, max_tokens=4, timeout=30, extra={"kv_transfer_params": params}
    )
    return reply, time.monotonic() - started


def test_hostile_params_straight_to_d_fail_fast_and_d_keeps_serving(
    cluster: tuple[Cluster, str],
) -> None:
    c, model = cluster
    warm = request(c.router.url, model, PROMPT, max_tokens=4)
    assert warm.ok, warm.error
    for name, params in HOSTILE.items():
        reply, took = hostile(c, model, params)
        assert not reply.ok and reply.status == 500, (name, reply.status, reply.error)
        # An invalid leg fails at its first step; the valid one at the handshake timeout.
        assert took < (HANDSHAKE + 5 if name == "dead_ranks" else 3.0), (name, took)
        assert c.d.alive(), name
    # The normal path right after: the same answer as before, through P and D.
    again = request(c.router.url, model, PROMPT, max_tokens=4)
    assert again.ok and again.token_ids == warm.token_ids, again.error
    wait_no_kv_in_use([c.p, c.d])


def test_requests_are_served_while_handshakes_to_dead_addresses_are_pending(
    cluster: tuple[Cluster, str],
) -> None:
    """Eight requests whose handshakes hang (every rank of each at a dead port) and,
    meanwhile, ordinary requests through the router: those are served at once."""
    c, model = cluster
    out: list[tuple[Reply, float]] = []
    lock = threading.Lock()

    def one(port: int) -> None:
        got = hostile(c, model, {**ISSUE, "remote_port": port, "remote_tp_size": 4})
        with lock:
            out.append(got)

    threads = [threading.Thread(target=one, args=(10 + 4 * i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for i in range(3):
        started = time.monotonic()
        reply = request(c.router.url, model, PROMPT[i:], max_tokens=4, timeout=30)
        assert reply.ok, reply.error
        assert time.monotonic() - started < HANDSHAKE + 3
    for t in threads:
        t.join(HANDSHAKE + 20)
    assert len(out) == 8 and all(not r.ok and took < HANDSHAKE + 10 for r, took in out), out
    assert c.d.alive()
    wait_no_kv_in_use([c.p, c.d])
