"""A decoder that computes another prompt than its prefiller (issue 37 item 2): D runs
with another chat template than P, so the same chat request becomes other token ids on
each side. P must refuse to push (PUSH_FAIL, cause prompt_mismatch) and D must then
recompute the prompt itself or fail the request, per vLLM's kv_load_failure_policy; the
client never gets an answer decoded over P's KV of another prompt. Real P, D, router and a
plain server (with D's template) on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
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
from tests.conftest import wait_until

pytestmark = pytest.mark.e2e

# The tiny model's own template (kvpush/tiny_model.py) writes "<|user|>\n...\n<|assistant|>\n";
# D's writes the roles another way: a prompt of other token ids, in as many blocks (one).
D_TEMPLATE = (
    "{% for message in messages %}"
    "[{{ message['role'] }}]: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)
CHAT = [{"role": "user", "content": "tell me about silver moons and golden rivers"}]
PROMPT = [(i * 7919) % 900 + 20 for i in range(200)]  # token ids: the same prompt on both
MISMATCH = "vllm:kvpush_push_failures_total"
RECEIVED = "vllm:kvpush_pushes_received_total"
LOCAL = "vllm:prompt_tokens_by_source_total"


def chat(url: str, model: str) -> Reply:
    return request(url, model, None, CHAT, max_tokens=8)


def completion(url: str, model: str) -> Reply:
    return request(url, model, PROMPT, max_tokens=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The model, D's template, a plain server's answers with D's template, and P (with
    the model's own template), started next to the plain server."""
    work = tmp_path_factory.mktemp("prompt_mismatch")
    model = make_tiny_model(str(work / "model"))
    template = work / "d_template.jinja"
    template.write_text(D_TEMPLATE)
    side_port = free_port()
    plain = VllmServer(
        ServerSpec(
            "plain", model, core=0, log_dir=str(work), extra_args=["--chat-template", str(template)]
        )
    )
    p_cfg = kvpush_config("kv_producer", "prefill", side_port)
    p = VllmServer(ServerSpec("prefill", model, kv_config=p_cfg, core=1, log_dir=str(work)))
    try:
        wait_healthy([plain, p])
        reference = {"chat": chat(plain.url, model), "completion": completion(plain.url, model)}
        plain.stop()
        assert all(r.ok for r in reference.values()), reference
        yield {
            "model": model,
            "work": work,
            "template": str(template),
            "side_port": side_port,
            "p": p,
            "reference": reference,
        }
    finally:
        plain.stop()
        p.stop()


@pytest.fixture(scope="module", params=["recompute", "fail"])
def cluster(base: dict[str, Any], request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """D with the other template and this kv_load_failure_policy, the router in front."""
    policy: str = request.param
    d_cfg = kvpush_config("kv_consumer", "decode", free_port())
    d_cfg["kv_load_failure_policy"] = policy
    log_dir = str(Path(base["work"]) / policy)
    d = VllmServer(
        ServerSpec(
            "decode",
            base["model"],
            kv_config=d_cfg,
            core=1,
            log_dir=log_dir,
            extra_args=["--chat-template", base["template"]],
        )
    )
    p: VllmServer = base["p"]
    router = RouterProc(p.url, d.url, f"127.0.0.1:{base['side_port']}", log_dir)
    try:
        wait_healthy([d, router])
        yield {**base, "d": d, "router": router, "policy": policy}
    finally:
        router.stop()
        d.stop()


def mismatches(server: VllmServer) -> float:
    return metric(server.url, MISMATCH, {"cause": "prompt_mismatch"})


def test_the_same_prompt_is_pushed(cluster: dict[str, Any]) -> None:
    """Token ids are the same prompt on both sides whatever the template: pushed as ever."""
    p, d, model = cluster["p"], cluster["d"], cluster["model"]
    received, p_seen = metric(d.url, RECEIVED), mismatches(p)
    got = completion(cluster["router"].url, model)
    ref = cluster["reference"]["completion"]
    assert got.ok, got.error
    assert got.token_ids == ref.token_ids
    wait_until(lambda: metric(d.url, RECEIVED) == received + 1, 20, what="D's pushed KV")
    assert mismatches(d) == 0 and mismatches(p) == p_seen


def test_a_chat_templated_otherwise_on_d_is_recomputed_or_fails(cluster: dict[str, Any]) -> None:
    p, d, model = cluster["p"], cluster["d"], cluster["model"]
    received = metric(d.url, RECEIVED)
    local = metric(d.url, LOCAL, {"source": "local_compute"})
    p_seen = mismatches(p)  # (P serves both policies' decoders)
    got = chat(cluster["router"].url, model)
    ref = cluster["reference"]["chat"]
    if cluster["policy"] == "recompute":
        # D computed the prompt itself, from its own template: a plain server's answer.
        assert got.ok, got.error
        assert got.token_ids and got.token_ids == ref.token_ids, (got.text, ref.text)
        computed = metric(d.url, LOCAL, {"source": "local_compute"}) - local
        assert computed >= ref.prompt_tokens
    else:
        assert not got.ok and got.status >= 500, (got.status, got.text)
    # Counted on both sides: P refused the registration, D's receive failed by it.
    wait_until(lambda: mismatches(p) == p_seen + 1 and mismatches(d) == 1, 20, what="the count")
    assert metric(d.url, RECEIVED) == received  # no KV of P's prompt was taken


def test_a_streamed_chat_templated_otherwise_gets_no_mixed_answer(cluster: dict[str, Any]) -> None:
    """Streamed and greedy, the client's first token comes from P's answer (router/head.py),
    of P's prompt; the rest comes from D only when D's own first token is the same, else
    the router asks D again and a first token that still differs ends the stream with an
    error. So again: a plain server's answer with D's template, or a clear failure."""
    p, d, model = cluster["p"], cluster["d"], cluster["model"]
    p_seen, d_seen = mismatches(p), mismatches(d)
    got = request(cluster["router"].url, model, None, CHAT, max_tokens=8, stream=True)
    ref = cluster["reference"]["chat"]
    if got.ok:
        assert got.token_ids and got.token_ids == ref.token_ids, (got.text, ref.text)
    else:
        assert got.error, got
    wait_until(lambda: mismatches(p) > p_seen and mismatches(d) > d_seen, 20, what="the count")
