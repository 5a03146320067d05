"""The layer-wise push through real vLLM on CPU (real NIXL between the servers): P pushes
every prompt layer by layer (``layerwise_min_tokens: 1``) and computes prompts over 256
tokens in chunks, so most requests push several chunks' layers; every output is checked
token for token against one plain vLLM server."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
from tests.conftest import plain_reference, wait_no_kv_in_use, wait_until
from tests.e2e.test_vllm_e2e import BLOCK, BYTES_PER_BLOCK, Case, ids, same

pytestmark = pytest.mark.e2e

LAYERS = 2  # the tiny model's
CHUNK = 256  # P's --max-num-batched-tokens: longer prompts take several steps
LAYER_WRITES = "vllm:kvpush_layer_writes_total"
CASES = [
    Case("one_block", ids(50, 1)),
    Case("one_chunk_exactly", ids(CHUNK, 2)),
    Case("two_chunks_mid_block", ids(300, 3)),  # chunk 2 starts inside block 2
    Case("two_chunks_streamed", ids(500, 4), stream=True, max_tokens=12),
]
CONCURRENT = [Case(f"concurrent_{i}", ids(100 + 90 * i, 20 + i)) for i in range(4)]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = str(tmp_path_factory.mktemp("layerwise"))
    model = make_tiny_model(work + "/model")
    plain = VllmServer(ServerSpec("plain", model, core=0, log_dir=work))
    reference = plain_reference(plain, model, CASES + CONCURRENT)
    side = free_port()
    p_config = kvpush_config("kv_producer", "prefill", side, layerwise_min_tokens=1)
    d_config = kvpush_config("kv_consumer", "decode", free_port())
    p = VllmServer(
        ServerSpec("prefill", model, kv_config=p_config, core=0, log_dir=work,
                   max_num_batched_tokens=CHUNK)
    )  # fmt: skip
    d = VllmServer(ServerSpec("decode", model, kv_config=d_config, core=1, log_dir=work))
    router = RouterProc(p.url, d.url, f"127.0.0.1:{side}", work)
    try:
        wait_healthy([p, d, router])
        yield {"model": model, "p": p, "d": d, "router": router, "reference": reference}
    finally:
        for proc in (router, d, p):
            proc.stop()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_token_identical_pushed_layer_by_layer(env: dict[str, Any], case: Case) -> None:
    p, d = env["p"], env["d"]
    received = metric(d.url, "vllm:kvpush_bytes_received_total")
    writes = metric(p.url, LAYER_WRITES)
    got = case.send(env["router"].url, env["model"])
    assert got.ok, got.error
    assert same(got, env["reference"][case.name]), (got.text, env["reference"][case.name].text)
    blocks = -(-got.prompt_tokens // BLOCK)
    assert metric(d.url, "vllm:kvpush_bytes_received_total") - received == blocks * BYTES_PER_BLOCK
    # One WRITE per layer and chunk (K and V of a layer go in one).
    chunks = -(-got.prompt_tokens // CHUNK)
    wait_until(
        lambda: metric(p.url, LAYER_WRITES) - writes == LAYERS * chunks, 10,
        what=f"{LAYERS * chunks} layer WRITEs",
    )  # fmt: skip


def test_concurrent_prompts_pushed_layer_by_layer(env: dict[str, Any]) -> None:
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        got = list(pool.map(lambda c: c.send(env["router"].url, env["model"]), CONCURRENT))
    for case, reply in zip(CONCURRENT, got, strict=True):
        assert same(reply, env["reference"][case.name]), (case.name, reply.error)


def test_nothing_held_and_nothing_failed_afterwards(env: dict[str, Any]) -> None:
    wait_no_kv_in_use([env["p"], env["d"]])
    for server in (env["p"], env["d"]):
        assert metric(server.url, "vllm:kvpush_push_failures_total") == 0
    # Each block written once: one a chunk leaves part-filled goes with the next chunk.
    sent = metric(env["p"].url, "vllm:kvpush_bytes_sent_total")
    assert sent == metric(env["d"].url, "vllm:kvpush_bytes_received_total")
    assert metric(env["p"].url, LAYER_WRITES) > 0
    # vLLM's CPU forward called save_kv_layer for every layer: none went at its end.
    assert metric(env["p"].url, "vllm:kvpush_layers_unreported_total") == 0
