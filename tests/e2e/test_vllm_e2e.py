"""Two real vLLM servers on CPU (prefiller, decoder) with kvpush and the router in front,
checked token for token against one plain vLLM server (prefix caching on everywhere, vLLM's
default)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from kvpush.deploy.client import Reply, request
from kvpush.deploy.demo import Cluster, make_prompts
from kvpush.deploy.servers import ServerSpec, VllmServer, metric
from kvpush.tiny_model import make_tiny_model
from tests.conftest import plain_reference, wait_no_kv_in_use, wait_until

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size
BYTES_PER_BLOCK = 2 * 64 * 1024  # tiny model: 2 layers x one 64 KiB block each
EARLY = "vllm:kvpush_early_hand_overs_total"
DESCS = "vllm:kvpush_write_descriptors_total"
SENT = "vllm:kvpush_pushes_sent_total"
RECEIVED = "vllm:kvpush_pushes_received_total"
SECRET = "e2e-shared-secret-4d0c2a9e"  # P and D prove it to each other at every handshake


@dataclass
class Case:
    name: str
    prompt: Any = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    max_tokens: int = 8

    def send(self, url: str, model: str) -> Reply:
        return request(url, model, self.prompt, self.messages, self.max_tokens, self.stream)


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 20 for i in range(n)]


SINGLE = [
    Case("shorter_than_a_block", ids(50, 1)),
    Case("exact_block_multiple", ids(2 * BLOCK, 2)),
    Case("near_max_length", ids(500, 3), max_tokens=8),
    Case("streamed", ids(300, 4), stream=True, max_tokens=12),
    Case("chat", messages=[{"role": "user", "content": "tell me about silver moons and rivers"}]),
]
CONCURRENT = [Case(f"concurrent_{i}", p) for i, p in enumerate(make_prompts(16, seed=11))]
# Two prompts opening with the same two blocks: the second finds them in D's prefix cache
# (cached there once the first one's KV arrived) and in P's.
_PREFIX = ids(2 * BLOCK, 21)
SHARED = [
    Case("prefix_first", _PREFIX + ids(60, 22)),
    Case("prefix_second", _PREFIX + ids(100, 23)),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("e2e")
    model = make_tiny_model(str(work / "model"))
    plain = VllmServer(ServerSpec("plain", model, core=0, log_dir=str(work)))
    reference = plain_reference(plain, model, SINGLE + CONCURRENT + SHARED)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPUSH_SHARED_SECRET", SECRET)  # the servers inherit the environment
        cluster = Cluster(model, str(work))
    with cluster:
        yield {"model": model, "cluster": cluster, "reference": reference}


def same(a: Reply, b: Reply) -> bool:
    return a.ok and b.ok and (a.token_ids == b.token_ids if a.token_ids else a.text == b.text)


@pytest.mark.parametrize("case", SINGLE, ids=[c.name for c in SINGLE])
def test_token_identical_through_router(env: dict[str, Any], case: Case) -> None:
    c: Cluster = env["cluster"]
    before = metric(c.d.url, "vllm:kvpush_bytes_received_total")
    early = metric(c.p.url, EARLY)
    got = case.send(c.router.url, env["model"])
    ref = env["reference"][case.name]
    assert got.ok, got.error
    assert got.token_ids, "the server returned no token ids"
    assert same(got, ref), (got.text, ref.text)
    # The KV of every prompt block came by push.
    pushed = metric(c.d.url, "vllm:kvpush_bytes_received_total") - before
    assert pushed == -(-got.prompt_tokens // BLOCK) * BYTES_PER_BLOCK
    # P pushed it from the end of its forward (hand_over "forward"), not after finishing it.
    wait_until(lambda: metric(c.p.url, EARLY) == early + 1, 10, what="P's early hand-over")


def test_16_concurrent_distinct_prompts(env: dict[str, Any]) -> None:
    c: Cluster = env["cluster"]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda case: case.send(c.router.url, env["model"]), CONCURRENT))
    for case, reply in zip(CONCURRENT, got, strict=True):
        assert same(reply, env["reference"][case.name]), (case.name, reply.error)


def test_decoder_did_not_compute_the_prompts(env: dict[str, Any]) -> None:
    c: Cluster = env["cluster"]
    before = {
        s: metric(c.d.url, "vllm:prompt_tokens_by_source_total", {"source": s})
        for s in ("local_compute", "external_kv_transfer")
    }
    reply = request(c.router.url, env["model"], ids(400, 9), max_tokens=4)
    assert reply.ok and reply.prompt_tokens == 400
    after = {
        s: metric(c.d.url, "vllm:prompt_tokens_by_source_total", {"source": s}) for s in before
    }
    assert after["external_kv_transfer"] - before["external_kv_transfer"] >= 399
    assert after["local_compute"] - before["local_compute"] <= 1  # the last prompt token


def test_a_prefix_cached_on_d_is_not_pushed(env: dict[str, Any]) -> None:
    """D's prefix cache holds the second prompt's first two blocks: P pushes only the
    third, into D's last block, and the answer is still the plain server's."""
    c: Cluster = env["cluster"]
    first, second = SHARED
    assert same(first.send(c.router.url, env["model"]), env["reference"][first.name])
    # P sees its WRITE done after D does, so P's stats for a push (its descriptors too)
    # can come after D's answer: baselines and counts are taken once P's count of pushes
    # caught up with D's (once, an earlier push's descriptors counted as the second's).
    pushes_counted(c)
    source = "vllm:prompt_tokens_by_source_total"
    pushed = metric(c.d.url, "vllm:kvpush_bytes_received_total")
    descs = metric(c.p.url, DESCS)
    d_hits = metric(c.d.url, source, {"source": "local_cache_hit"})
    p_hits = metric(c.p.url, source, {"source": "local_cache_hit"})
    got = second.send(c.router.url, env["model"])
    assert same(got, env["reference"][second.name]), (got.text, got.error)
    assert metric(c.d.url, "vllm:kvpush_bytes_received_total") - pushed == BYTES_PER_BLOCK
    assert metric(c.d.url, source, {"source": "local_cache_hit"}) - d_hits == 2 * BLOCK
    wait_until(  # P's stats for the request may come a step after its answer
        lambda: metric(c.p.url, source, {"source": "local_cache_hit"}) - p_hits == 2 * BLOCK,
        10,
        what="P's prefix cache hit",
    )
    # One block in each of the two layers: a descriptor each.
    pushes_counted(c)
    assert metric(c.p.url, DESCS) - descs == 2


def pushes_counted(c: Cluster) -> None:
    """Wait until P's stats count every push D received (none failed in this module)."""
    wait_until(
        lambda: metric(c.p.url, SENT) == metric(c.d.url, RECEIVED), 10, what="P's push count"
    )


def test_no_blocks_held_afterwards(env: dict[str, Any]) -> None:
    c: Cluster = env["cluster"]
    wait_no_kv_in_use([c.p, c.d])
    assert metric(c.p.url, "vllm:kvpush_push_failures_total") == 0


def test_the_secret_shows_in_no_server_log(env: dict[str, Any]) -> None:
    c: Cluster = env["cluster"]
    for server in (c.p, c.d):
        text = server.log_path.read_text(errors="replace")
        assert "KVPushConnector" in text  # vLLM printed its config, kvpush's options included
        assert SECRET not in text
        assert "no shared secret" not in text  # both side channels run with the secret
