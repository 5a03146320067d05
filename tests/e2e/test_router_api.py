"""Through the router, every OpenAI request behaves as on one plain vLLM server.

One set of real servers for the module: a plain vLLM server, a kvpush prefiller and
decoder, and the router in front of them. Each case of `router_cases.CASES` goes to the
plain server and through the router; answers must be equal up to what names a server
(ids, timestamps, the config fingerprint), logprobs within float tolerance. Refusals must
come back with the plain server's status and body, quickly. Afterwards neither P nor D
may hold a block, and neither may have failed a push.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvpush.deploy.demo import Cluster
from kvpush.deploy.servers import RouterProc, ServerSpec, VllmServer, metric, wait_healthy
from kvpush.tiny_model import make_tiny_model
from tests.conftest import wait_until
from tests.e2e.cut_link import CutLink
from tests.e2e.router_cases import CASES, CHAT, COMPLETIONS, MESSAGES, PROMPT, Case, ids

pytestmark = pytest.mark.e2e

# What names the server rather than the answer.
UNSTABLE = {"id", "created", "system_fingerprint"}
PUSHES = "vllm:kvpush_pushes_received_total"
FAILURES = "vllm:kvpush_push_failures_total"
FINISHED = "vllm:request_success_total"
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("router-api")
    model = make_tiny_model(str(work / "model"))
    plain = VllmServer(ServerSpec("plain", model, core=1, log_dir=str(work)))
    # D logs each request's abort: test_client_hang_up_cancels_both_legs waits for it.
    cluster = Cluster(model, str(work), decode_args=["--enable-log-requests"])
    try:
        wait_healthy([plain, cluster.p, cluster.d, cluster.router])
        yield {"model": model, "plain": plain.url, "cluster": cluster}
    finally:
        cluster.stop()
        plain.stop()


def send(base: str, case: Case, model: str, timeout: float = 60.0) -> tuple[int, Any, float]:
    """(status, parsed answer, seconds): a JSON body, or a stream's list of events."""
    if case.raw is not None:
        data = case.raw.replace(b"@MODEL@", model.encode())
    else:
        data = json.dumps({"model": model, **case.body}).encode()
    req = urllib.request.Request(base + case.path, data, {"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
            stream = resp.headers.get("Content-Type", "").startswith("text/event-stream")
    except urllib.error.HTTPError as e:
        status, raw, stream = e.code, e.read(), False
    elapsed = time.monotonic() - start
    if not stream:
        return status, json.loads(raw), elapsed
    events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
    return status, [e if e == "[DONE]" else json.loads(e) for e in events], elapsed


def strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in UNSTABLE}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def merged(events: list[Any]) -> dict[Any, Any]:
    """A stream as what it says per choice: text, token ids and logprobs joined, the last
    finish and stop reason, the last usage; plus the final usage chunk. How tokens are cut
    into chunks is not part of the answer: vLLM joins the deltas of a request whose
    reader lags (its RequestOutputCollector), on any server."""
    assert events and events[-1] == "[DONE]", events
    out: dict[Any, Any] = {}
    for event in events[:-1]:
        assert "error" not in event, event
        if not event.get("choices"):
            out["usage"] = event.get("usage")
            continue
        for choice in event["choices"]:
            got = out.setdefault(choice["index"], {})
            for key, value in choice.items():
                _join(got, key, value)
            if event.get("usage"):
                got["usage"] = event["usage"]
    return out


def _join(into: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, dict):
        sub = into.get(key)
        if not isinstance(sub, dict):
            sub = into[key] = {}
        for k, v in value.items():
            _join(sub, k, v)
    elif isinstance(value, (str, list)) and key not in ("finish_reason", "stop_reason", "role"):
        into[key] = into.get(key, value[:0]) + value
    elif value is not None or key not in into:
        into[key] = value


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where a and b differ; floats (logprobs) within tolerance."""
    if isinstance(a, float) and isinstance(b, float):
        ok = math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)
        return [] if ok else [f"{path}: {a} != {b}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_answer_as_one_plain_server(env: dict[str, Any], case: Case) -> None:
    c: Cluster = env["cluster"]
    want_status, want, _ = send(env["plain"], case, env["model"])
    got_status, got, elapsed = send(c.router.url, case, env["model"])
    assert (400 <= want_status < 500) == case.refused, (want_status, want)
    assert got_status == want_status, (got, want)
    if case.refused:
        assert got == want  # vLLM's own body, word for word
        assert elapsed < 3.0, f"a refusal took {elapsed:.1f}s"
        return
    if case.stream:
        diff = differences(merged(strip(got)), merged(strip(want)))
    else:
        diff = differences(strip(got), strip(want))
    assert not diff, "\n".join(diff[:20])


def test_each_sub_request_got_its_own_push(env: dict[str, Any]) -> None:
    """Three prompts with n=2: six engine requests on D, six pushes, one per sub-request."""
    c: Cluster = env["cluster"]
    prompts = [ids(300, 11), ids(60, 12), ids(129, 13)]
    case = Case("fan", COMPLETIONS, {"prompt": prompts, "n": 2, "seed": 5, "max_tokens": 3})
    pushes = metric(c.d.url, PUSHES)
    status, body, _ = send(c.router.url, case, env["model"])
    assert status == 200 and len(body["choices"]) == 6, body
    # vLLM's counters follow its engine's output: poll them.
    wait_until(lambda: metric(c.d.url, PUSHES) - pushes >= 6, 10.0, what="six pushes")
    assert metric(c.d.url, PUSHES) - pushes == 6
    assert body["usage"]["prompt_tokens"] == 300 + 60 + 129


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_the_first_token_comes_from_p_while_d_is_frozen(env: dict[str, Any], path: str) -> None:
    """A streamed greedy request: the client's first token is P's (D is stopped until
    the client has it), and the whole answer is still the plain server's."""
    c: Cluster = env["cluster"]
    body: dict[str, Any] = {"stream": True, "temperature": 0, "max_tokens": 8}
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": PROMPT})
    case = Case("frozen_d", path, body)
    _, want, _ = send(env["plain"], case, env["model"])
    full = {"model": env["model"], **body}
    events, gave_up = _stream_with_d_stopped(c, c.router.url + path, full)
    assert not gave_up, "no first token from P while D was stopped"
    assert not differences(merged(strip(events)), merged(strip(want)))
    assert metric(c.router.url, "kvpush_router_first_token_mismatch_total") == 0


def test_a_first_token_with_u_fffd_in_its_text_comes_from_p(env: dict[str, Any]) -> None:
    """A prompt that ends inside a character (token 225: the byte 0x80 alone): vLLM's
    first event holds the prompt's text from that byte on, U+FFFD and all, in P's finished
    stream as in an unfinished one. The client gets P's event while D is stopped, and the
    answer is the plain server's."""
    c: Cluster = env["cluster"]
    body: dict[str, Any] = {"stream": True, "temperature": 0, "max_tokens": 8}
    body["prompt"] = [*ids(40, 3), 225]
    _, want, _ = send(env["plain"], Case("u_fffd", COMPLETIONS, body), env["model"])
    assert "\ufffd" in want[0]["choices"][0]["text"], want[0]  # the case this test is for
    full = {"model": env["model"], **body}
    events, gave_up = _stream_with_d_stopped(c, c.router.url + COMPLETIONS, full)
    assert not gave_up, "no first token from P while D was stopped"
    assert not differences(merged(strip(events)), merged(strip(want)))


def _stream_with_d_stopped(c: Cluster, url: str, body: dict[str, Any]) -> tuple[list[Any], bool]:
    """Stream ``body`` from ``url`` with D stopped until the client has its first event;
    the events (``[DONE]`` as a string), and whether D had to be resumed after 20 s without
    one (then that event was not P's)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    events: list[Any] = []
    gave_up = threading.Event()

    def resume() -> None:
        gave_up.set()
        c.d.send(signal.SIGCONT)

    c.d.send(signal.SIGSTOP)
    timer = threading.Timer(20.0, resume)
    timer.start()
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
                    c.d.send(signal.SIGCONT)  # the first event came while D was stopped
    finally:
        timer.cancel()
        c.d.send(signal.SIGCONT)
    return events, gave_up.is_set()


def test_client_hang_up_cancels_both_legs(env: dict[str, Any], tmp_path: Path) -> None:
    """The client leaves mid-stream, on P's first token: the router ends D's leg though D
    is silent, D aborts the request (and, as it never scheduled it, tells P so), and
    neither P nor D holds a block well within P's 30 s lease.

    D's engine (its processes; its API server runs on) is stopped from before the request
    until D's API server has sent it the request and then, after the hang-up, the abort
    (vLLM logs both), so D cannot finish first. It once was D as a whole, frozen when its
    first event reached the link and resumed as a whole: but D's engine runs ahead of its
    own API server (seen: 97 tokens ahead when the first event reached the link, and all
    400 done once before the resumed API server took the hang-up), and vLLM then counted
    a finished request (CI: ``assert 103.0 == 102.0``, about one run in four)."""
    c: Cluster = env["cluster"]
    body = {"model": env["model"], "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    body.update(stream=True, temperature=0)
    # vLLM records a finished request's counters with the scheduler's gauges, after the
    # answer may have left: once D shows idle, earlier tests' requests are all counted.
    _wait_idle(c, "before the test")
    before = metric(c.d.url, FINISHED), metric(c.d.url, GENERATED)
    logged = c.d.log_path.stat().st_size
    with via_link(c, tmp_path, hold=False) as (router, link):
        engine = psutil.Process(c.d.popen.pid).children(recursive=True)
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(router.url + COMPLETIONS, json.dumps(body).encode(), headers)
        try:
            for proc in engine:
                proc.send_signal(signal.SIGSTOP)
            with urllib.request.urlopen(req, timeout=60) as resp:
                tid = resp.headers["X-Request-Id"]  # in D's request id
                first = resp.readline()
                while not first.startswith(b"data:"):
                    first = resp.readline()
                assert json.loads(first[5:])["choices"][0]["text"], first  # P's token
                # Leave once D's engine has the request (else D never sees it, and P
                # holds its KV for the whole lease).
                added = "added request"
                wait_until(lambda: _logged(c.d, tid, added, logged), 30.0, what=f"D adding {tid}")
            assert link.closed_by_router.wait(10), "D's stream open 10 s after the client left"
            aborted = "aborted request"
            wait_until(lambda: _logged(c.d, tid, aborted, logged), 30.0, what=f"D aborting {tid}")
        finally:
            c.d.send(signal.SIGCONT)
        _wait_idle(c, "after the client hung up")
        assert metric(router.url, "kvpush_router_first_token_total", {"leg": "prefill"}) == 1
    # vLLM counts no aborted request as finished; a completed one would count.
    assert metric(c.d.url, FINISHED) == before[0]
    assert metric(c.d.url, GENERATED) - before[1] < 399


def _logged(server: VllmServer, request_id: str, words: str, since: int) -> bool:
    """D's log from byte ``since`` on has a line with ``words`` (any case) about
    ``request_id``. With ``--enable-log-requests`` vLLM's API server logs "Added request"
    once it has sent a request to its engine, "Aborted request(s)" once it has sent the
    abort."""
    with open(server.log_path, "rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    return any(request_id in line and words in line.lower() for line in text.splitlines())


def test_nothing_held_and_no_push_failed(env: dict[str, Any]) -> None:
    # Well within P's lease (30 s): blocks held for a refused or abandoned request would
    # show here.
    c: Cluster = env["cluster"]
    _wait_idle(c, "after the matrix")
    assert metric(c.p.url, FAILURES) == 0 and metric(c.d.url, FAILURES) == 0


def _wait_idle(c: Cluster, what: str, timeout: float = 10.0) -> None:
    def state() -> dict[str, float]:
        return {
            f"{s.spec.name} {m}": metric(s.url, f"vllm:{m}")
            for s in (c.p, c.d)
            for m in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
        }

    deadline = time.monotonic() + timeout
    while any((now := state()).values()):
        if time.monotonic() > deadline:
            pytest.fail(f"P and D not idle {what} after {timeout:g}s: {now}")
        time.sleep(0.2)


def test_ds_differing_first_token_goes_on_from_ps(env: dict[str, Any], tmp_path: Path) -> None:
    """D's first token is made to differ from P's on the way to the router (a near tie
    on a GPU would do that): D's continuation would follow the wrong token, so the router
    asks D to go on from P's token (the prompt's ids P returned, P's token after them, one
    token fewer), and the answer, usage included, is still the plain server's. D is stopped
    until the client has P's token, so the head path is taken."""
    c: Cluster = env["cluster"]
    body: dict[str, Any] = {"prompt": PROMPT, "stream": True, "temperature": 0, "max_tokens": 8}
    body["stream_options"] = {"include_usage": True}
    _, want, _ = send(env["plain"], Case("again", COMPLETIONS, body), env["model"])
    assert want[-2]["usage"]["completion_tokens"] == 8
    with via_link(c, tmp_path, hold=False, rewrite_first=_other_first_char) as (router, link):
        url = router.url + COMPLETIONS
        events, gave_up = _stream_with_d_stopped(c, url, {"model": env["model"], **body})
        assert not gave_up, "no first token from P while D was stopped"
        assert link.passed_first.is_set()
        assert len(link.posts) == 2, "D was not asked again"
        assert metric(router.url, "kvpush_router_first_token_mismatch_total") == 1
        assert metric(router.url, "kvpush_router_first_token_total", {"leg": "prefill"}) == 1
        assert "D goes on from P's" in (tmp_path / "router.log").read_text()
    assert not differences(merged(strip(events)), merged(strip(want)))
    _wait_idle(c, "after the request went on from P's token")


def _other_first_char(data: bytes) -> bytes:
    """The first event's text with another first character, of the same length."""
    key = b'"text":"'
    at = data.find(key) + len(key)
    assert at >= len(key) and data[at] < 0x80 and data[at : at + 1] not in (b'"', b"\\"), data
    other = b"Y" if data[at : at + 1] == b"X" else b"X"
    return data[:at] + other + data[at + 1 :]


def test_stream_cut_by_a_dead_decoder_ends_with_an_error_event(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """Last: it kills D. The client sees the tokens so far, an OpenAI-style error event,
    then [DONE]; never a clean-looking end. A second router reaches D through a link that
    holds D's stream after its first event, so D cannot finish before it dies."""
    c: Cluster = env["cluster"]
    body = {"model": env["model"], "prompt": PROMPT, "max_tokens": 450, "ignore_eos": True}
    body.update(stream=True, temperature=0)
    events = []
    with via_link(c, tmp_path) as (router, link):
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(router.url + COMPLETIONS, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert link.passed_first.wait(30), "D's first event never went through the link"
            c.d.kill()
            link.cut()
            for line in resp:
                if line.startswith(b"data:"):
                    events.append(line[5:].strip())
    # The tokens so far (D's first event; P's first token may have come before it, from
    # the router's first-token path), the router's error, [DONE].
    assert len(events) >= 3, events
    assert all("choices" in json.loads(e) for e in events[:-2]), events
    error = json.loads(events[-2])["error"]
    assert error["leg"] == "decode" and error["code"] == 502, error
    assert events[-1] == b"[DONE]"


@contextmanager
def via_link(c: Cluster, log_dir: Path, **link: Any) -> Iterator[tuple[RouterProc, CutLink]]:
    """A second router over the same P and D, reaching D through a `CutLink`."""
    cut = CutLink(int(c.d.url.rsplit(":", 1)[1]), **link)
    router = RouterProc(c.p.url, cut.url, f"127.0.0.1:{c.side_port}", str(log_dir))
    try:
        wait_healthy([router])
        yield router, cut
    finally:
        router.stop()
        cut.close()
