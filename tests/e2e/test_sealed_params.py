"""Sealed kv_transfer_params with real servers (P, D and the router, each with
KVPUSH_PARAMS_SECRET): the router's legs push as always, and a client's own params sent
straight to P or D are ignored, so that P holds no blocks for it (without the secret it
holds them for lease_s, 30 s) and D answers from its own prefill, as a plain server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpush.core import seal
from kvpush.deploy.client import request
from kvpush.deploy.demo import Cluster
from kvpush.deploy.servers import metric
from kvpush.tiny_model import make_tiny_model
from tests.conftest import wait_no_kv_in_use

pytestmark = pytest.mark.e2e

PROMPT = [(i * 7919) % 900 + 20 for i in range(100)]
OTHER = [(i * 104729) % 900 + 20 for i in range(100)]
RECEIVED = "vllm:kvpush_bytes_received_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    work = tmp_path_factory.mktemp("sealed")
    model = make_tiny_model(str(work / "model"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv(seal.ENV, "a params secret of the tests")  # inherited by every server
        with Cluster(model, str(work), max_model_len=512) as c:
            yield c, model


def test_the_routers_sealed_legs_push(cluster: tuple[Cluster, str]) -> None:
    c, model = cluster
    before = metric(c.d.url, RECEIVED) or 0.0
    reply = request(c.router.url, model, PROMPT, max_tokens=4)
    assert reply.ok, reply.error
    deadline = time.monotonic() + 30
    while (metric(c.d.url, RECEIVED) or 0.0) <= before:  # vLLM logs stats every few s
        assert time.monotonic() < deadline, "D received no KV by push"
        time.sleep(0.2)


def test_a_clients_own_params_straight_to_p_or_d_are_ignored(
    cluster: tuple[Cluster, str],
) -> None:
    c, model = cluster
    via = request(c.router.url, model, PROMPT, max_tokens=4)
    assert via.ok, via.error
    wait_no_kv_in_use([c.p, c.d])
    # To P: a prefill leg for a decoder that never comes; forged seals change nothing.
    for params in (
        {"do_remote_decode": True, "transfer_id": "mine"},
        {"do_remote_decode": True, "transfer_id": "mine2", "kvpush_seal": "0" * 64},
    ):
        reply = request(c.p.url, model, OTHER, max_tokens=1, extra={"kv_transfer_params": params})
        assert reply.ok, reply.error
        wait_no_kv_in_use([c.p], timeout=5.0)  # freed at its end, not after lease_s (30 s)
    # To D: a decode leg naming the real P, which has no such request: D computes the
    # prompt itself and answers as the router's pair did.
    side = {"remote_host": "127.0.0.1", "remote_port": c.side_port, "transfer_id": "x"}
    started = time.monotonic()
    reply = request(
        c.d.url,
        model,
        PROMPT,
        max_tokens=4,
        extra={"kv_transfer_params": {"do_remote_prefill": True, **side}},
    )
    assert reply.ok and reply.token_ids == via.token_ids, reply.error
    assert time.monotonic() - started < 5.0
    wait_no_kv_in_use([c.p, c.d], timeout=5.0)
    assert "not sealed by the router" in c.p.tail(400) + c.d.tail(400)
