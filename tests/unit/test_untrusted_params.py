"""A request's kv_transfer_params are untrusted (issue 37): D checks them as strictly as the
wire, fails a bad one alone and at once, and no address they name can hold up the decoder
(handshakes off the ticking thread, bounded in number, a failure answers a flood)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpush.core.errors import ConfigError, HandshakeError, TransportError
from kvpush.core.handshake import fetch_agent_info
from kvpush.core.memory_transport import MemoryTransport
from kvpush.core.types import RecvRegistration
from kvpush.core.worker import make_agent_name
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.params import MAX_OTHER_ITEMS, BadParams, check_recv_params
from kvpush.vllm.scheduler_side import SchedulerSide, p_key, transfer_key
from kvpush_bench.sim.engine import SimEngine, SimSpec
from tests.conftest import free_port
from tests.unit.test_push_states import FAST, Pair

GOOD = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5700}


@dataclass
class Req:
    request_id: str
    kv_transfer_params: Any
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(40)))


def decoder() -> SchedulerSide:
    return SchedulerSide("D", ConnectorOptions.parse({}, env={}), False, True, 1)


def test_legs_of_kvpush_and_of_the_in_tree_push_connector_pass() -> None:
    ours = {
        **GOOD,
        "do_remote_decode": False,
        "transfer_id": "t1",
        "remote_engine_id": "prefill",
        "remote_tp_size": 2,
        "remote_pp_size": 2,
        "remote_request_id": "cmpl-x-0-abcdef12",
        "tp_size": 2,
        "pp_size": 2,
    }
    in_tree = {
        **GOOD,
        "remote_engine_id": "p0",
        "tp_size": 8,
        "pp_size": 1,
        "remote_request_id": "r",
        "remote_block_ids": [[1, 2], [3]],
        "remote_num_tokens": 40,
        "dcp_size": 1,
        "remote_blocks_expiry_time": 12.5,
    }
    for params in (GOOD, ours, in_tree, {**GOOD, "remote_host": "p-0.svc.local"}):
        check_recv_params(params)
        d = decoder()
        req = Req("cmpl-a-0-00000000", dict(params))
        d.update_state_after_alloc(req, ([1, 2, 3],), 40, block_size=16)
        meta = d.sched.build_meta()
        assert not meta.rejected and len(meta.registrations) == 1


BAD: list[tuple[dict[str, Any], str]] = [
    ({"remote_port": True}, "remote_port must be an integer"),
    ({"remote_port": "5700"}, "remote_port must be an integer"),
    ({"remote_port": 0}, "remote_port must be an integer in"),
    ({"remote_port": 70000}, "remote_port must be an integer in"),
    ({"remote_port": 10**100}, "integer of 333 bits"),
    ({"remote_port": 65530, "remote_tp_size": 8}, "up to port 65537"),
    ({"remote_tp_size": 8.0}, "remote_tp_size must be an integer"),
    ({"remote_tp_size": 0}, "remote_tp_size must be an integer"),
    ({"remote_tp_size": 100_000}, "remote_tp_size must be an integer in [1, 1024]"),
    ({"tp_size": -1}, "tp_size must be an integer"),
    ({"remote_pp_size": 10**6}, "remote_pp_size must be"),
    ({"remote_tp_size": 64, "pp_size": 64}, "64 x 64 prefiller ranks"),
    ({"remote_host": {"a": 1}}, "remote_host must be a string"),
    ({"remote_host": ["127.0.0.1"]}, "remote_host must be a string"),
    ({"remote_host": 2130706433}, "remote_host must be a string"),
    ({"remote_host": "h" * 300}, "a string of 300 characters"),
    ({"remote_host": ""}, "remote_host must be a string"),
    ({"remote_host": "*"}, "is not a host"),
    ({"remote_host": "a b"}, "is not a host"),
    ({"remote_host": "tcp://x"}, "is not a host"),
    ({"remote_host": "h;127.0.0.1"}, "is not a host"),
    ({"remote_host": None}, "lack the prefiller's side channel"),
    ({"remote_port": None}, "lack the prefiller's side channel"),
    ({"remote_engine_id": {"x": 1}}, "remote_engine_id must be a string"),
    ({"transfer_id": 123}, "transfer_id must be a string"),
    ({"transfer_id": "t" * 300}, "a string of 300 characters"),
    ({"remote_engine_id": "e" * 600}, "a string of 600 characters"),
    ({"remote_request_id": ["r"]}, "remote_request_id must be a string"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill must be true or false"),
    ({"something": {"a": {"b": 1}}}, "something: dict value too large or nested"),
    ({"remote_block_ids": [[[1]]]}, "remote_block_ids: list value"),
    ({"remote_block_ids": list(range(MAX_OTHER_ITEMS + 1))}, "remote_block_ids: list value"),
    ({"remote_block_ids": [list(range(MAX_OTHER_ITEMS))] * 2}, "remote_block_ids: list value"),
    ({"note": "x" * 5000}, "note: str value too large"),
    ({f"k{i}": i for i in range(100)}, "have 103 keys"),
    ({1: 2}, "key 1 is not a short string"),
    ({"k" * 100: 1}, "is not a short string"),
]


@pytest.mark.parametrize("extra,why", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_leg_fails_that_request_alone_and_at_once(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(BadParams) as e:
        check_recv_params({**GOOD, **extra})
    assert why in str(e.value) and len(str(e.value)) < 300  # never echoes a huge value
    d = decoder()
    bad = Req("cmpl-bad-0-00000000", {**GOOD, **extra, "do_remote_prefill": True})
    if "do_remote_prefill" in extra:
        bad.kv_transfer_params["do_remote_prefill"] = extra["do_remote_prefill"]
    assert d.get_num_new_matched_tokens(bad, 0) == (40, True)  # it waits for its KV ...
    d.update_state_after_alloc(bad, ([1, 2, 3],), 40, block_size=16)
    good = Req("cmpl-good-0-00000000", dict(GOOD))
    d.update_state_after_alloc(good, ([4, 5, 6],), 40, block_size=16)
    meta = d.sched.build_meta()  # ... and fails in the next step; the other one registers
    assert list(meta.rejected) == [bad.request_id]
    assert meta.rejected[bad.request_id].startswith("invalid kv_transfer_params")
    assert [r.request_id for r in meta.registrations] == [good.request_id]


def test_a_client_cannot_mark_its_params_as_registered() -> None:
    """The connector once kept "registered" as a key in the request's own params, which a
    client sending straight to D could set (red-team run, 2026-12-07): its params then went
    unchecked. Now the mark's value is D's own secret token: such a leg is checked, and
    refused, like any other."""
    d = decoder()
    bad = Req("cmpl-mark-0-00000000", {**GOOD, "remote_port": "9", "_kvpush_registered": True})
    assert d.get_num_new_matched_tokens(bad, 0) == (40, True)
    d.update_state_after_alloc(bad, ([1, 2, 3],), 40, block_size=16)
    assert list(d.sched.build_meta().rejected) == [bad.request_id]
    # D's own mark still holds: the calls after the KV came change nothing.
    assert d.get_num_new_matched_tokens(bad, 40) == (0, False)
    d.update_state_after_alloc(bad, ([1, 2, 3],), 40, block_size=16)
    assert not d.sched.build_meta().rejected


def test_checking_is_linear_in_what_it_looks_at() -> None:
    huge: list[dict[str, Any]] = [
        {f"k{i}": i for i in range(1_000_000)},
        {**GOOD, "remote_block_ids": list(range(10_000_000))},
        {**GOOD, "remote_host": "h" * 10_000_000},
        {**GOOD, "remote_block_ids": [[0] * 10_000] * 10_000},
    ]
    for params in huge:
        started = time.perf_counter()
        with pytest.raises(BadParams):
            check_recv_params(params)
        assert time.perf_counter() - started < 0.5


def test_p_ranks_are_linear_in_the_tp_size(pair_factory: Callable[..., Pair]) -> None:
    """The core's rank arithmetic (here past any bound the connector allows) was
    quadratic: ``i in srcs`` over a list, for every rank."""
    pair = pair_factory()
    reg = RecvRegistration("r", [[1]], "P", "127.0.0.1", 1, remote_tp_size=40_000)
    started = time.perf_counter()
    ranks = pair.d.worker.consumer._p_ranks(reg)
    assert time.perf_counter() - started < 1.0 and len(ranks) == 40_000 and all(s for _, s in ranks)


def test_the_core_refuses_more_prefiller_ranks_than_it_addresses(
    pair_factory: Callable[..., Pair],
) -> None:
    pair = pair_factory()
    pair.d.register("r1", "t1", 2, "P", "127.0.0.1", 1000, p_tp=2000)
    pair.until(lambda: "failed" in pair.d_kinds("r1"), timeout=5.0, what="r1 failed")
    pair.d.register("r2", "t2", 2, "P", "127.0.0.1", 65000, p_tp=600)
    pair.until(lambda: "failed" in pair.d_kinds("r2"), timeout=5.0, what="r2 failed")
    assert pair.d.worker.stats["handshakes"] == 0


def dead_or_live(dead: set[int], timeout: float, calls: list[int]) -> Callable[..., Any]:
    """A handshake that hangs to its timeout for ``dead`` ports (a blackholed address),
    else the real one."""

    def fetch(host: str, port: int, *a: Any, **k: Any) -> Any:
        calls.append(port)
        if port in dead:
            time.sleep(timeout)
            raise HandshakeError(f"no handshake answer from {host}:{port} in {timeout}s")
        return fetch_agent_info(host, port, *a, **k)

    return fetch


def failed_reason(pair: Pair, rid: str) -> str:
    for kind, r, info in pair.d_events:
        if r == rid and kind == "failed":
            return str(info.get("reason", ""))
    return ""


def test_a_dead_address_costs_its_requests_not_the_decoder(
    pair_factory: Callable[..., Pair],
) -> None:
    """Eight dead P ranks and a flood of requests naming one of them: each handshake runs
    once, on its own thread, so a live prefiller's request goes through at once (with a
    pool of four it waited two handshake timeouts), and every request to the dead address
    fails after the handshake timeout (not the watchdog, 30 s here)."""
    hang = 2.0
    calls: list[int] = []
    dead_port = free_port()
    dead = set(range(dead_port, dead_port + 8))
    pair = pair_factory(d_engine={"fetch": dead_or_live(dead, hang, calls)})
    pair.step()
    started = time.monotonic()
    pair.d.register("hostile", "h", 1, "P", "127.0.0.1", dead_port, p_tp=8)
    for i in range(40):
        pair.d.register(f"flood{i}", f"f{i}", 1, "P", "127.0.0.1", dead_port)
    pair.step()
    pair.p.prefill("p1", "t1", 4)
    pair.register("d1", "t1", 4)
    pair.until(lambda: "recv" in pair.d_kinds("d1"), timeout=hang - 0.5, what="live receive")
    rids = ["hostile"] + [f"flood{i}" for i in range(40)]
    pair.until(
        lambda: all(failed_reason(pair, r) for r in rids), timeout=hang + 3, what="all failed"
    )
    assert time.monotonic() - started < hang + 3
    assert all("handshake" in failed_reason(pair, r) for r in rids)
    assert sorted(calls.count(p) for p in dead) == [1] * 8  # one handshake per address


def test_handshakes_are_bounded_per_host_and_overall(pair_factory: Callable[..., Pair]) -> None:
    """With four handshake threads, at most two wait on one host: a registration that
    needs a third fails at once, not after the dead ones' timeout."""
    calls: list[int] = []
    dead_port = free_port()
    fetch = dead_or_live(set(range(dead_port, dead_port + 8)), 3.0, calls)
    pair = pair_factory(d_engine={"fetch": fetch}, d_kw={"worker": {"handshake_workers": 4}})
    pair.step()
    started = time.monotonic()
    pair.d.register("wide", "w", 1, "P", "127.0.0.1", dead_port, p_tp=8)
    pair.until(lambda: bool(failed_reason(pair, "wide")), timeout=2.0, what="wide failed")
    assert time.monotonic() - started < 2.0 and "not tried" in failed_reason(pair, "wide")
    assert len(calls) == 2 and pair.d.worker.stats["handshake_refused_busy"] >= 1


def test_a_failed_handshake_is_retried_once_its_waiters_are_gone(
    pair_factory: Callable[..., Pair],
) -> None:
    """Rank 1's handshake ended (failed) after its request had already failed by rank 0:
    the table kept it and answered every later registration with that rank with the old
    failure, for good. Now the next registration tries again."""
    first = threading.Event()
    pair_port: list[int] = []

    def fetch(host: str, port: int, *a: Any, **k: Any) -> Any:
        if port != pair_port[0]:
            raise HandshakeError("rank 0 is dead")
        if not first.is_set():
            first.set()
            time.sleep(0.3)
            raise HandshakeError("not up yet")
        return fetch_agent_info(host, port, *a, **k)

    pair = pair_factory(d_engine={"fetch": fetch})
    pair_port.append(pair.p.spec.port)
    pair.d.register("a", "ta", 1, "P", "127.0.0.1", pair.p.spec.port - 1, p_tp=2)
    pair.until(lambda: bool(failed_reason(pair, "a")), timeout=3.0, what="a failed")
    pair.until(lambda: not pair.d.worker.peers.handshakes, timeout=3.0, what="handshakes over")
    pair.p.prefill("p1", "t1", 2)
    pair.register("b", "t1", 2)
    pair.until(lambda: "recv" in pair.d_kinds("b"), timeout=5.0, what="b received")


def test_trusted_prefillers_limit_where_d_may_be_sent() -> None:
    opts = ConnectorOptions.parse({"trusted_prefillers": ["127.0.0.1:5700"]}, env={})
    d = SchedulerSide("D", opts, False, True, 1)
    listed = Req("cmpl-a-0-00000000", dict(GOOD))
    other = Req("cmpl-b-0-00000000", {**GOOD, "remote_port": 5800})
    for req in (listed, other):
        d.update_state_after_alloc(req, ([1],), 16, block_size=16)
    meta = d.sched.build_meta()
    assert [r.request_id for r in meta.registrations] == [listed.request_id]
    assert "not one of trusted_prefillers" in meta.rejected[other.request_id]
    # Aborted before allocation: no withdrawal (a handshake) towards an unlisted address.
    gone = Req("cmpl-c-0-00000000", {**GOOD, "remote_port": 5800})
    assert d.request_finished(gone, []) == (False, None)
    assert not d.sched.build_meta().withdrawn
    with pytest.raises(ConfigError, match="trusted_prefillers entry"):
        ConnectorOptions.parse({"trusted_prefillers": "no-port"}, env={})


def test_p_keys_only_by_a_transfer_id_d_could_send_back() -> None:
    """P reads transfer_id too (p_key): one D could not send within wire.Name (or not a
    string) is ignored, and P keys the request by its own id."""
    for bad in (123, {"a": [1]}, ["t"], "t" * 300):
        assert transfer_key("cmpl-x-0-abcdef12", bad) is None
        assert p_key("cmpl-x-0-abcdef12", {"transfer_id": bad}) == "cmpl-x-0"
    assert transfer_key("cmpl-x-1-abcdef12", "t" * 256) == "t" * 256 + ":1:0"


def test_an_unknown_host_fails_its_handshake_on_the_pool_thread() -> None:
    """A name is resolved by the handshake's own thread, and a name that does not resolve
    fails at once (ZMQ resolved it on its I/O thread, shared with the side-channel server,
    and the handshake waited out its timeout)."""
    started = time.monotonic()
    with pytest.raises(HandshakeError, match="cannot resolve no-such-host.invalid:5700"):
        fetch_agent_info("no-such-host.invalid", 5700, "D", 3.0)
    assert time.monotonic() - started < 2.5


def test_a_peer_whose_nixl_address_never_answers_costs_a_handshake_thread(
    pair_factory: Callable[..., Pair],
) -> None:
    """Q answers the handshake, but its NIXL address does not answer (with NIXL: 3 s in
    add_remote_agent where nobody answers ARP, over 2 min where the path drops packets).
    That connection is tried on the handshake thread (``probe``), so while it hangs D
    serves a live prefiller; then Q's requests fail, and D never loads Q on its ticking
    thread."""
    pair = pair_factory()
    q = SimEngine(
        SimSpec("Q", free_port(), worker=FAST),
        MemoryTransport(pair.fabric, make_agent_name("Q", 0)),
    )
    gate, probing = threading.Event(), threading.Event()

    def probe(agent: str) -> None:
        if agent.startswith("Q"):
            probing.set()
            assert gate.wait(10.0)
            raise TransportError("connect: No route to host")

    pair.fabric.probe = probe
    try:
        pair.d.register("q1", "tq", 2, "Q", "127.0.0.1", q.spec.port)  # type: ignore[arg-type]
        pair.until(probing.is_set, timeout=5.0, what="Q's probe")
        pair.p.prefill("p1", "t1", 4)
        pair.register("d1", "t1", 4)
        pair.until(lambda: "recv" in pair.d_kinds("d1"), timeout=5.0, what="live receive")
        assert not failed_reason(pair, "q1")
        gate.set()
        pair.until(lambda: bool(failed_reason(pair, "q1")), timeout=5.0, what="q1 failed")
        assert "cannot be reached" in failed_reason(pair, "q1")
        assert make_agent_name("Q", 0) not in pair.d.worker.peers.by_agent
    finally:
        gate.set()
        q.close()
