"""Real vLLM servers on one GPU: kvpush's P and D with the router in front, against vLLM's
own NixlConnector (pull) on the same GPU and one plain server.

Every P/D connector differs from one plain server at the same places (bf16 numerics of a
decode that starts from another process's KV), so outputs are compared token for token
with NixlConnector's, and the first token with the plain server's. Skipped without CUDA
(CI has none); run on the GPU machine (docs/benchmarks.md has the command).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from kvpush.deploy.client import Reply, request  # noqa: E402
from kvpush.deploy.servers import metric  # noqa: E402
from kvpush.tiny_model import make_tiny_model  # noqa: E402
from kvpush_bench.pairs import KvpushPair, make_pair  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_LEN = 8192
SPEC = {
    "device": "cuda",
    "max_model_len": MAX_LEN,
    "max_num_seqs": 16,
    "max_num_batched_tokens": MAX_LEN,
    "gpu_memory_utilization": 0.1,
    "kv_cache_bytes": 4 << 30,
    "cuda_graphs": True,  # as users run vLLM: decode steps as CUDA graphs
}
# The layer-wise push over NIXL (issue 23): every prompt layer by layer, no CUDA IPC copy
# (which would take same-host pushes whole), in chunks of 2,048 tokens on P (the longer
# prompts span several steps).
LAYERED = {"layerwise_min_tokens": 1, "peer_copy": "off"}
LAYERED_CHUNK = 2048
LAYERS = 16  # the bench model's
LAYER_WRITES = "vllm:kvpush_layer_writes_total"
PAIRS = ("kvpush", "layered")
# Random weights give flat logits (five tokens within 0.2 of the best): a batch of another
# size (its own kernels and CUDA graph), or KV that prefix caching reuses from another
# batch's prefill, can flip a greedy choice between two tokens whose logprobs lie this
# close (0.0625 seen once in 16 concurrent with prefix caching on, 2026-12-03).
NEAR_TIE = 0.1


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 20 for i in range(n)]


@dataclass
class Case:
    name: str
    prompt: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    stream: bool = False
    max_tokens: int = 12


CASES = [
    Case("one_token", ids(1, 1)),
    Case("short", ids(37, 2)),
    Case("exact_block_multiple", ids(16 * 20, 3)),
    Case("long", ids(4000, 4), stream=True),
    Case("near_max_length", ids(MAX_LEN - 40, 5), max_tokens=16),
    Case("streamed", ids(600, 6), stream=True, max_tokens=20),
    Case("chat", messages=[{"role": "user", "content": "tell me of silver moons and rivers"}]),
    Case(
        "chat_streamed",
        messages=[
            {"role": "system", "content": "you answer briefly"},
            {"role": "user", "content": "what moves the cache between the two servers"},
        ],
        stream=True,
    ),
]
CONCURRENT = [Case(f"c{i}", ids(200 + 97 * i, 100 + i), stream=i % 2 == 0) for i in range(16)]


def send(url: str, model: str, case: Case, **kw: Any) -> Reply:
    return request(
        url, model, case.prompt, case.messages, case.max_tokens, case.stream, timeout=120, **kw
    )


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


Top = list[dict[int, float]]  # per position: token id -> logprob of the top five


def pull(p_url: str, d_url: str, model: str, case: Case) -> tuple[list[int], Top]:
    """vLLM's NixlConnector as its proxy drives it: the prefill leg, then the decode leg
    with the kv_transfer_params P returned, both under one X-Request-Id. Not streamed
    (the tokens are the same): its token ids and, per position, the top-5 logprobs."""
    headers = {"X-Request-Id": uuid.uuid4().hex, "Content-Type": "application/json"}
    chat = case.messages is not None
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": model, "temperature": 0, "return_token_ids": True}
    body["return_tokens_as_token_ids"] = True  # logprobs keyed "token_id:N"
    body.update({"messages": case.messages} if chat else {"prompt": case.prompt})
    first = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = _post(p_url + path, first, headers)["kv_transfer_params"]
    body.update(max_tokens=case.max_tokens, kv_transfer_params=params)
    body.update({"logprobs": True, "top_logprobs": 5} if chat else {"logprobs": 5})
    choice = _post(d_url + path, body, headers)["choices"][0]
    return list(choice["token_ids"]), _top(choice["logprobs"], chat)


def _top(logprobs: dict[str, Any], chat: bool) -> Top:
    """Per position: token id -> logprob of the five likeliest tokens."""
    if chat:
        return [
            {int(t["token"].split(":")[1]): t["logprob"] for t in pos["top_logprobs"]}
            for pos in logprobs["content"]
        ]
    return [{int(k.split(":")[1]): v for k, v in pos.items()} for pos in logprobs["top_logprobs"]]


def divergence(got: list[int], ref: list[int], top: Top) -> str:
    """Where ``got`` first leaves ``ref``, and how far its token was from the best there."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            t = top[i]
            gap = max(t.values()) - t[a] if a in t else None
            return f"position {i}: {a} vs {b}, logprob gap {gap} (near tie: <= {NEAR_TIE})"
    return f"lengths {len(got)} vs {len(ref)}"


def same_or_near_tie(got: list[int], ref: list[int], top: Top) -> bool:
    """Equal, or equal up to a position where ``got`` took another token that the
    reference had among its top five within NEAR_TIE of its best (the sequences may
    differ from there)."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            t = top[i]
            return a in t and max(t.values()) - t[a] <= NEAR_TIE
    return len(got) == len(ref)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("gpu-e2e")
    model = os.environ.get("KVPUSH_GPU_MODEL") or make_tiny_model(
        str(work / "model"), shape="bench"
    )
    pairs = {n: make_pair(n, model, str(work / n), **SPEC) for n in ("plain", "kvpush", "pull")}
    layered = KvpushPair(model, str(work / "layered"), **SPEC)
    layered.spec["max_num_batched_tokens"] = LAYERED_CHUNK
    layered.name, layered.options = "layered", LAYERED
    pairs["layered"] = layered
    with ThreadPoolExecutor(len(pairs)) as pool:
        list(pool.map(lambda p: p.start(timeout=420), pairs.values()))
    try:
        yield {"model": model, "refs": {}, **pairs}
    finally:
        for p in pairs.values():
            p.stop()


def _tokens(r: Reply) -> list[int]:
    assert r.ok, r.error
    assert r.token_ids, "no token ids returned"
    return r.token_ids


def _check(servers: dict[str, Any], case: Case, got: Reply, exact: bool = True) -> bool:
    """kvpush's output against NixlConnector's (exactly, or up to a near tie) and its
    first token against one plain server's; True when the tokens were all equal."""
    model, pl = servers["model"], servers["pull"]
    # NixlConnector's first answer to the case: sent again, its prefix cache gives other
    # bf16 numerics (on one H100 a second "short" flipped its fourth token), so every
    # contender is held to the same answer.
    refs = servers["refs"]
    if case.name not in refs:
        refs[case.name] = pull(pl.p.url, pl.d.url, model, case)
    ref, top = refs[case.name]
    plain = _tokens(send(servers["plain"].server.url, model, case))
    mine = _tokens(got)
    assert mine[0] == plain[0] or same_or_near_tie(mine[:1], plain[:1], top), case.name
    if exact:
        assert mine == ref, (case.name, mine, ref)
    else:
        assert same_or_near_tie(mine, ref, top), (case.name, divergence(mine, ref, top))
    return mine == ref


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_token_identical_to_nixl_connector(servers: dict[str, Any], case: Case, pair: str) -> None:
    kv = servers[pair]
    before = metric(kv.d.url, "vllm:kvpush_pushes_received_total")
    writes = metric(kv.p.url, LAYER_WRITES)
    got = send(kv.router.url, servers["model"], case)
    _check(servers, case, got)
    assert metric(kv.d.url, "vllm:kvpush_pushes_received_total") == before + 1
    if pair == "layered":  # one WRITE per layer and chunk
        want = LAYERS * -(-got.prompt_tokens // LAYERED_CHUNK)
        # vLLM's counters follow its engine's output: poll them.
        wait_until(lambda: metric(kv.p.url, LAYER_WRITES) - writes >= want, 10.0, what="WRITEs")
        assert metric(kv.p.url, LAYER_WRITES) - writes == want


@pytest.mark.parametrize("pair", PAIRS)
def test_16_concurrent(servers: dict[str, Any], pair: str) -> None:
    kv = servers[pair]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda c: send(kv.router.url, servers["model"], c), CONCURRENT))
    # Batched on D, compared with NixlConnector one at a time: equal up to a near tie
    # (KV that is wrong moves logits far more than that), and outright for at least a
    # quarter (a random model has many bf16 ties: 10 of 16 on one H200 in most runs, 7 in
    # one on 2026-12-03, whose near-tie checks all held).
    pairs = zip(CONCURRENT, got, strict=True)
    equal = [_check(servers, case, reply, exact=False) for case, reply in pairs]
    assert sum(equal) >= len(CONCURRENT) // 4, equal


@pytest.mark.parametrize("pair", PAIRS)
def test_nothing_held_and_metrics_true(servers: dict[str, Any], pair: str) -> None:
    kv = servers[pair]
    deadline = time.monotonic() + 30
    while True:
        usage = [metric(s.url, "vllm:kv_cache_usage_perc") for s in (kv.p, kv.d)]
        if usage == [0.0, 0.0]:
            break
        assert time.monotonic() < deadline, f"KV cache still in use: P, D = {usage}"
        time.sleep(0.2)
    sent = metric(kv.p.url, "vllm:kvpush_pushes_sent_total")
    received = metric(kv.d.url, "vllm:kvpush_pushes_received_total")
    assert sent == received >= len(CASES) + len(CONCURRENT)
    assert metric(kv.p.url, "vllm:kvpush_bytes_sent_total") == metric(
        kv.d.url, "vllm:kvpush_bytes_received_total"
    )
    assert metric(kv.p.url, "vllm:kvpush_push_failures_total") == 0
    if pair == "layered":
        # Every layer went as its attention wrote it, none at the forward's end.
        assert metric(kv.p.url, "vllm:kvpush_layers_unreported_total") == 0
