"""kvpush as a drop-in for vLLM's in-tree NixlPushConnector (docs/migration.md): real vLLM
servers on CPU driven with the in-tree connector's per-request contract, the way its
proxies send it, once with kvpush's connector and once with vLLM's own; every answer equal
to a plain server's, the prompt's KV pushed (D computes at most the last token), nothing
held afterwards. The kvpush half also checks the decoder legs that can never pair (fail
fast) and that every metric the Grafana dashboard (docs/grafana/kvpush.json) queries is on
the live servers' /metrics with the labels it uses."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpush.deploy.client import Reply, request
from kvpush.deploy.servers import (
    RouterProc,
    ServerSpec,
    VllmServer,
    free_port,
    metric,
    wait_healthy,
)
from kvpush.tiny_model import make_tiny_model
from kvpush_bench import server_metrics
from tests.conftest import plain_reference, wait_no_kv_in_use, wait_until

pytestmark = pytest.mark.e2e

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvpush.json"
SECRET = "drop-in-shared-secret-7b1e"
EXTERNAL = "vllm:prompt_tokens_by_source_total"
P_ENGINE = "prefill"  # both pairs' prefiller engine id


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 20 for i in range(n)]


# How a proxy drives the pair (the in-tree contract): which ids the legs carry, and when
# the decode leg goes. "both": the proxy builds D's kv_transfer_params itself (naming P's
# request in remote_request_id) and sends both legs at once; "prefill_first": it sends P's
# leg, then D's with the kv_transfer_params P answered with, as vLLM's disaggregated
# proxies do.
MODES = ["same_ids_both", "same_ids_prefill_first", "own_ids_both", "own_ids_prefill_first"]
# vLLM 0.32's NixlPushConnector pairs D's registration with P's finished request by D's own
# request id (push_worker._pop_matching_finished_blocks: exact, then without the engine
# suffix); remote_request_id only feeds its heartbeats. Legs with different ids never
# pair there: D waits for its registration watchdog. Not a CPU limit, so not run.
IN_TREE_CANNOT = (
    "vLLM 0.32's NixlPushConnector pairs by the decode leg's own request id (push_worker."
    "_pop_matching_finished_blocks) and ignores remote_request_id for pairing: legs with "
    "different X-Request-Ids never pair there"
)


@dataclass
class Case:
    name: str
    prompt: list[int]
    max_tokens: int = 8

    def send(self, url: str, model: str) -> Reply:
        return request(url, model, self.prompt, max_tokens=self.max_tokens)


# A prompt per mode and size, so that no prompt finds an earlier one's KV in D's cache.
CASES = {
    mode: [Case(f"{mode}_short", ids(60, 10 + i)), Case(f"{mode}_long", ids(300, 20 + i))]
    for i, mode in enumerate(MODES)
}
FAIL_PROMPTS = [Case(f"fail_{i}", ids(100, 40 + i)) for i in range(5)]


@dataclass
class PD:
    """A prefiller and a decoder, either connector, and what the decode leg names."""

    kind: str
    p: VllmServer
    d: VllmServer
    side_port: int
    model: str
    router: Any = None


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("drop_in")
    model = make_tiny_model(str(work / "model"))
    plain = VllmServer(ServerSpec("plain", model, core=0, log_dir=str(work)))
    cases = [c for group in CASES.values() for c in group]
    return {"work": work, "model": model, "reference": plain_reference(plain, model, cases)}


# vLLM's own pair, driven alike, shows the requests are the in-tree contract; it is not run
# in CI: vLLM 0.32's NixlPushConnector itself lost one same-id leg in 3 of the 6 runs up to
# 2026-12-05 (on an idle machine too): its P released the finished request's blocks at
# their lease ("retrieved by 0 remote worker(s)") while its D waited on the KV ("KV fetch:
# 1 in progress") until the client gave up, with nothing of kvpush in either process.
# KVPUSH_DROP_IN_IN_TREE=1 runs it.
PAIRS = ["kvpush", "in_tree"] if os.environ.get("KVPUSH_DROP_IN_IN_TREE") == "1" else ["kvpush"]


@pytest.fixture(scope="module", params=PAIRS)
def pd(request: pytest.FixtureRequest, base: dict[str, Any]) -> Iterator[PD]:
    """One pair at a time (2 cores), configured alike: vLLM's own NixlPushConnector, or
    kvpush's with exactly the change docs/migration.md gives (the connector's name and
    module; same engine ids, same side-channel environment). kvpush's pair also gets its
    router, for the dashboard's metrics."""
    work, model, kind = str(base["work"]), base["model"], request.param
    side = free_port()

    def server(name: str, role: str, core: int, port: int) -> VllmServer:
        kv = {"kv_connector": "NixlPushConnector", "kv_role": role, "engine_id": name}
        env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
        if kind == "kvpush":
            kv.update(kv_connector="KVPushConnector", kv_connector_module_path="kvpush.vllm")
            env["KVPUSH_SHARED_SECRET"] = SECRET
        spec = ServerSpec(f"{kind}-{name}", model, kv_config=kv, core=core, env=env, log_dir=work)
        return VllmServer(spec)

    procs: list[Any] = [server(P_ENGINE, "kv_producer", 0, side)]
    procs.append(server("decode", "kv_consumer", 1, free_port()))
    if kind == "kvpush":
        procs.append(RouterProc(procs[0].url, procs[1].url, f"127.0.0.1:{side}", work))
    try:
        wait_healthy(procs)
        yield PD(kind, procs[0], procs[1], side, model, procs[2] if len(procs) > 2 else None)
    finally:
        for proc in reversed(procs):
            proc.stop()


def post(url: str, body: dict[str, Any], headers: dict[str, str], timeout: float = 60) -> Any:
    req = urllib.request.Request(
        url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def prefill_leg(pd: PD, case: Case, rid: str) -> dict[str, Any]:
    """P's leg as the in-tree proxies send it; the kv_transfer_params P answers with."""
    body = {
        "model": pd.model,
        "prompt": case.prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = post(pd.p.url, body, {"X-Request-Id": rid}).get("kv_transfer_params")
    assert isinstance(params, dict), params
    return params


def decode_params(pd: PD, p_rid: str, **over: Any) -> dict[str, Any]:
    """D's kv_transfer_params as a proxy builds them for the in-tree push connector."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": P_ENGINE,
        "remote_host": "127.0.0.1",
        "remote_port": pd.side_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": f"cmpl-{p_rid}-0",  # vLLM's id of P's request, less its suffix
        **over,
    }


def decode_leg(pd: PD, case: Case, rid: str, params: dict[str, Any], timeout: float = 60) -> Reply:
    extra = {"kv_transfer_params": params}
    headers = {"X-Request-Id": rid}
    return request(
        pd.d.url, pd.model, case.prompt, None, case.max_tokens, False, timeout, headers, extra
    )


def drive(pd: PD, mode: str, case: Case) -> Reply:
    p_rid = uuid.uuid4().hex
    d_rid = p_rid if mode.startswith("same_ids") else uuid.uuid4().hex
    if mode.endswith("prefill_first"):
        return decode_leg(pd, case, d_rid, prefill_leg(pd, case, p_rid))
    errors: list[BaseException] = []

    def p_leg() -> None:
        try:
            prefill_leg(pd, case, p_rid)
        except BaseException as e:  # (reported below, on the test's thread)
            errors.append(e)

    leg = threading.Thread(target=p_leg, daemon=True)
    leg.start()
    reply = decode_leg(pd, case, d_rid, decode_params(pd, p_rid))
    leg.join(60)
    assert not errors, errors
    return reply


def same(a: Reply, b: Reply) -> bool:
    return a.ok and b.ok and a.token_ids == b.token_ids and bool(a.token_ids)


@pytest.mark.parametrize("mode", MODES)
def test_in_tree_contract_answers_as_a_plain_server(
    pd: PD, base: dict[str, Any], mode: str
) -> None:
    if pd.kind == "in_tree" and mode.startswith("own_ids"):
        pytest.skip(IN_TREE_CANNOT)
    for case in CASES[mode]:
        before = metric(pd.d.url, EXTERNAL, {"source": "external_kv_transfer"})
        got = drive(pd, mode, case)
        ref = base["reference"][case.name]
        assert got.ok, (case.name, got.status, got.error)
        assert same(got, ref), (case.name, got.token_ids, ref.token_ids)
        # The prompt's KV came from P: D computed at most its last token.
        pushed = metric(pd.d.url, EXTERNAL, {"source": "external_kv_transfer"}) - before
        assert pushed >= len(case.prompt) - 1, (case.name, pushed)


def elapsed(fn: Callable[[], Reply]) -> tuple[Reply, float]:
    start = time.monotonic()
    reply = fn()
    return reply, time.monotonic() - start


def test_legs_that_can_never_pair_fail_fast(pd: PD) -> None:
    """kvpush only (the in-tree connector waits for its watchdog): a decode leg naming
    another engine id, or a P request that already ended, is failed by P at once; one
    naming a P request that never comes (a wrong remote_request_id) after P's
    unknown_request_grace_s (5 s; it waited for registration_ttl_s, 60 s, before); one
    naming a prefiller nobody runs fails at D's handshake timeout (5 s)."""
    if pd.kind != "kvpush":
        pytest.skip("kvpush's fail-fast answers; the in-tree connector has none")
    unpairable = {"cause": "unpairable"}
    before = metric(pd.p.url, "vllm:kvpush_push_failures_total", unpairable)
    wrong_engine, ended, nobody, ok, unknown = FAIL_PROMPTS
    rid = uuid.uuid4().hex
    got, took = elapsed(
        lambda: decode_leg(
            pd, wrong_engine, rid, decode_params(pd, rid, remote_engine_id="another-engine")
        )
    )
    print(f"failed in {took:.2f} s: {got.status} {got.error[:200]}")
    assert not got.ok and took < 15, (got, took)
    assert "another-engine" in log_tail(pd.p), "P said nothing of the engine id it refused"
    # A pair that works, then a second decode leg naming the same (now ended) P request.
    p_rid = uuid.uuid4().hex
    assert drive_own(pd, ok, p_rid).ok
    got, took = elapsed(lambda: decode_leg(pd, ended, uuid.uuid4().hex, decode_params(pd, p_rid)))
    print(f"failed in {took:.2f} s: {got.status} {got.error[:200]}")
    assert not got.ok and took < 15, (got, took)
    # A decode leg naming a P request that never comes (no prefill leg is sent).
    wrong = uuid.uuid4().hex
    got, took = elapsed(lambda: decode_leg(pd, unknown, uuid.uuid4().hex, decode_params(pd, wrong)))
    print(f"failed in {took:.2f} s: {got.status} {got.error[:200]}")
    assert not got.ok and 5 <= took < 15, (got, took)
    assert f"no request of this prefiller is named 'cmpl-{wrong}-0'" in log_tail(pd.p)
    # P's stats reach /metrics with its engine's steps: an idle P takes one for them.
    assert request(pd.p.url, pd.model, ids(20, 97), max_tokens=2).ok
    wait_until(
        lambda: metric(pd.p.url, "vllm:kvpush_push_failures_total", unpairable) - before == 3,
        10,
        what="P's count of unpairable registrations",
    )
    port = free_port()  # nothing listens there
    got, took = elapsed(
        lambda: decode_leg(
            pd, nobody, uuid.uuid4().hex, decode_params(pd, uuid.uuid4().hex, remote_port=port)
        )
    )
    print(f"failed in {took:.2f} s: {got.status} {got.error[:200]}")
    assert not got.ok and took < 20, (got, took)


def log_tail(server: VllmServer) -> str:
    return server.log_path.read_text(errors="replace")[-20000:]


def drive_own(pd: PD, case: Case, p_rid: str) -> Reply:
    p = threading.Thread(target=prefill_leg, args=(pd, case, p_rid), daemon=True)
    p.start()
    reply = decode_leg(pd, case, uuid.uuid4().hex, decode_params(pd, p_rid))
    p.join(60)
    return reply


# ---- the dashboard ---------------------------------------------------------------------

# Router series that only a failure of its kind creates (a labelled counter has no sample
# before its first increment): for these, the declared family is enough.
ONLY_ON_FAILURE = {"kvpush_router_retries_total"}
_NAME = re.compile(r"\b((?:vllm:|kvpush_router_)[a-z_:]+)")
_BY = re.compile(r"by \(([^)]*)\)")
_MATCH = re.compile(r"\{([^}]*)\}")


def dashboard_queries() -> list[tuple[str, set[str]]]:
    """(metric name, label names) of every query of the dashboard: the labels each groups
    by or matches on (``le`` of a histogram bucket aside)."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            labels = {x.strip() for m in _BY.findall(expr) for x in m.split(",")} - {"le", ""}
            labels |= {
                kv.split("=")[0].strip() for m in _MATCH.findall(expr) for kv in m.split(",")
            }
            for name in _NAME.findall(expr):
                out.append((name, labels - {""}))
    return out


def samples(url: str) -> tuple[dict[str, list[set[str]]], set[str]]:
    """Each sample's metric name at ``url``/metrics with the label names it carries, and
    the names of the counters among the declared families (``# TYPE``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[set[str]]] = {}
    counters = set()
    for line in text.splitlines():
        if line.startswith("# TYPE ") and line.endswith(" counter"):
            name = line.split()[2]  # (prometheus_client: with _total; others may leave it)
            counters |= {name, name if name.endswith("_total") else name + "_total"}
        if not line or line.startswith("#"):
            continue
        head = line.rsplit(" ", 1)[0]
        name, _, rest = head.partition("{")
        labels = {kv.split("=")[0] for kv in re.findall(r'(\w+)="', rest)}
        out.setdefault(name, []).append(labels)
    return out, counters


def test_every_dashboard_metric_is_served_with_its_labels(pd: PD) -> None:
    if pd.kind != "kvpush":
        pytest.skip("the dashboard is kvpush's")
    # One request through the router, and one it fails (a prompt too long for the
    # model: P refuses it), so its latency and failure series have samples too.
    assert request(pd.router.url, pd.model, ids(80, 98), max_tokens=4).ok
    assert not request(pd.router.url, pd.model, ids(600, 99), max_tokens=4).ok
    scraped: dict[str, list[set[str]]] = {}
    declared: set[str] = set()
    for server in (pd.p.url, pd.d.url, pd.router.url):
        served, types = samples(server)
        declared |= types
        for name, label_sets in served.items():
            scraped.setdefault(name, []).extend(label_sets)
    queries = dashboard_queries()
    assert len(queries) >= 20
    missing = []
    for name, labels in queries:
        got = scraped.get(name, [])
        if not got and name in ONLY_ON_FAILURE and name in declared:
            continue
        # Prometheus adds ``instance`` (the scraped server) and renames a served one
        # ``exported_instance``: that one must be served as ``instance``.
        want = {"instance" if x == "exported_instance" else x for x in labels - {"instance"}}
        if not any(want <= have for have in got):
            missing.append((name, sorted(want), got[:2]))
    assert not missing, missing


def test_p_and_d_serve_the_timings_the_load_report_reads(pd: PD) -> None:
    """scripts/load_bench_gpu.py splits a contender's TTFT with these (kvpush_bench.
    server_metrics): they must be served under the names it reads, one request each."""
    if pd.kind != "kvpush":
        pytest.skip("the load benchmark drives kvpush's pair through its router")
    before = {s.url: server_metrics.scrape(s.url) for s in (pd.p, pd.d)}
    assert request(pd.router.url, pd.model, ids(90, 97), max_tokens=4).ok

    def both_seen() -> bool:
        return all(server_metrics.means(b, server_metrics.scrape(u))["n"] == 1
                   for u, b in before.items())  # fmt: skip

    wait_until(both_seen, 10, what="one request in P's and D's TTFT histograms")
    for url, b in before.items():
        got = server_metrics.means(b, server_metrics.scrape(url))
        assert all(got[f"{k}_ms"] >= 0 for k in server_metrics.FAMILIES), (url, got)


def test_nothing_held_afterwards(pd: PD) -> None:
    wait_no_kv_in_use([pd.p, pd.d])
    if pd.kind == "kvpush":
        for cause in ("nixl_write", "lease_expired", "registration_expired", "watchdog"):
            assert metric(pd.p.url, "vllm:kvpush_push_failures_total", {"cause": cause}) == 0
