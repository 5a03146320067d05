"""A burst of requests through the router: P and D survive it, and every answer is one
plain vLLM server's (issue 37, item 3).

Each round sends 48 requests at once: streamed completions of 3-130 random words with
2-24 tokens, every second one sampled with a seed (the burst that killed P's engine), and
among them requests with ``n`` > 1, several prompts in one request, and chat, streamed or
not. Before the fix P's CPU engine died: P's steps are all prefills, so vLLM computed the
last prompt a step admitted only in part and then rewound that request's own generator for
the token it threw away, which a CPU generator cannot do (kvpush.router.bodies: P's leg now
gets no seed).

Greedy answers must be the plain server's token for token; seeded ones too: vLLM's CPU
sampler draws one noise seed per sampled step from the request's own generator, so a
request sampled with the same seed over the same steps gets the same tokens on any server
(D's first step samples the first token from a fresh generator, as the plain server's
does). The plain server gets a token budget that holds all its sequences at once
(``max_num_batched_tokens``), so it never computes a prompt in part and cannot itself meet
the generator rewind that this test is about.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.deploy.demo import WORDS
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
from tests.conftest import wait_no_kv_in_use
from tests.e2e.router_cases import CHAT, COMPLETIONS, Case
from tests.e2e.test_router_api import differences, merged, send, strip

pytestmark = pytest.mark.e2e

ROUNDS = 5
REQUESTS = 48
SEQS = 8  # --max-num-seqs of every server, as in the report
MAX_LEN = 512
P_STEP = 1024  # P's --max-num-batched-tokens
FAILURES = "vllm:kvpush_push_failures_total"
# The kinds of request in a round, in turn: mostly the report's streamed completion.
KINDS = ("completion", "completion", "completion", "n", "completion", "prompts", "chat", "chat")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = str(tmp_path_factory.mktemp("burst"))
    model = make_tiny_model(work + "/model")

    def spec(name: str, core: int, **kw: Any) -> ServerSpec:
        return ServerSpec(name, model, core=core, max_num_seqs=SEQS, log_dir=work, **kw)

    side = free_port()
    # P's steps are all prefills: with vLLM's CPU default of 2048 tokens a step, the report's
    # burst made P compute a prompt in part only now and then (it died in 2 of 2 tries, but
    # 5 rounds here once passed without the fix); half that makes nearly every full step do.
    p_config = kvpush_config("kv_producer", "prefill", side)
    p = VllmServer(spec("prefill", 0, kv_config=p_config, max_num_batched_tokens=P_STEP))
    d = VllmServer(spec("decode", 1, kv_config=kvpush_config("kv_consumer", "decode", free_port())))
    plain = VllmServer(spec("plain", 1, max_num_batched_tokens=SEQS * MAX_LEN))
    router = RouterProc(p.url, d.url, f"127.0.0.1:{side}", work)
    try:
        wait_healthy([plain, p, d, router])
        yield {"model": model, "p": p, "d": d, "plain": plain, "router": router}
    finally:
        for proc in (router, d, p, plain):
            proc.stop()


def _words(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, most)))


def burst(round_: int) -> list[Case]:
    """One round's requests (the same for a round on every run)."""
    rng = random.Random(round_)
    cases = []
    for i in range(REQUESTS):
        kind = KINDS[i % len(KINDS)]
        most = rng.randint(2, 24)
        body: dict[str, Any] = {"stream": kind == "completion" or rng.random() < 0.5}
        seeded = i % 2 == 1 or kind == "n"
        if seeded:
            body.update(temperature=0.8, seed=rng.randrange(2**31))
        else:
            body["temperature"] = 0
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body.update(messages=[{"role": "user", "content": _words(rng, 100)}])
            body["max_completion_tokens"] = most
            if seeded and rng.random() < 0.5:
                body["n"] = 2
            cases.append(Case(f"r{round_}-{i}-chat", CHAT, body))
            continue
        body.update(max_tokens=most, return_token_ids=True)
        if kind == "prompts":
            body["prompt"] = [_words(rng, 60) for _ in range(rng.randint(2, 3))]
        else:
            body["prompt"] = _words(rng, 130)  # at most ~450 tokens, + 24 < MAX_LEN
        if kind == "n" or (kind == "prompts" and seeded):
            body["n"] = rng.choice((2, 3))
        cases.append(Case(f"r{round_}-{i}-{kind}", COMPLETIONS, body))
    return cases


def send_all(url: str, model: str, cases: list[Case]) -> dict[str, Any]:
    """Every case sent at once; each one's (status, answer), or the exception it raised."""
    out: dict[str, Any] = {}

    def one(case: Case) -> None:
        try:
            status, answer, _ = send(url, case, model, timeout=180.0)
            out[case.name] = (status, answer)
        except Exception as exc:  # noqa: BLE001 - reported with the case below
            out[case.name] = exc

    threads = [threading.Thread(target=one, args=(case,)) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_burst_gets_the_plain_servers_answers(env: dict[str, Any], round_: int) -> None:
    cases = burst(round_)
    got = send_all(env["router"].url, env["model"], cases)
    want = send_all(env["plain"].url, env["model"], cases)
    dead = [s.spec.name for s in (env["p"], env["d"], env["plain"]) if not s.alive()]
    assert not dead, f"engine gone: {dead}"
    wrong = []
    for case in cases:
        a, b = got[case.name], want[case.name]
        if isinstance(a, Exception) or isinstance(b, Exception) or a[0] != 200 or b[0] != 200:
            wrong.append(f"{case.name}: router {_short(a)}; plain {_short(b)}")
            continue
        if case.stream:
            diff = differences(merged(strip(a[1])), merged(strip(b[1])))
        else:
            diff = differences(strip(a[1]), strip(b[1]))
        if diff:
            wrong.append(f"{case.name} ({case.body}): " + "; ".join(diff[:3]))
    assert not wrong, f"{len(wrong)} of {len(cases)} differ:\n" + "\n".join(wrong[:10])
    # Nothing held, no push failed, and the engines still answer.
    wait_no_kv_in_use([env["p"], env["d"]], timeout=30.0)
    assert metric(env["p"].url, FAILURES) == 0 and metric(env["d"].url, FAILURES) == 0
    wait_healthy([env["p"], env["d"]], timeout=5.0)


def _short(answer: Any) -> str:
    return repr(answer)[:300]
