"""The in-tree push connector's contract on kvpush's connector (docs/migration.md): D names
P's request in ``remote_request_id``; precedence transfer_id > remote_request_id > base id;
registrations that can never pair are failed by P at once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpush.core import pairing
from kvpush.core.errors import HandshakeError
from kvpush.core.ids import ANY_ENGINE, Key, MatchTable, names_other_engine
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.scheduler_side import SchedulerSide, named_key, registration
from tests.unit.test_push_states import Pair, recv_ok
from tests.unit.test_vllm_adapter import FakeRequest

SIDE = {"remote_host": "127.0.0.1", "remote_port": 5700}


def test_named_key_is_ps_name_of_the_same_sub_request() -> None:
    assert named_key("cmpl-d-0-99ff0011", "cmpl-p-0") == "cmpl-p-0"
    assert named_key("cmpl-d-0-99ff0011", "cmpl-p-0-a1b2c3d4") == "cmpl-p-0"  # P's answer
    assert named_key("cmpl-d-2-99ff0011", "cmpl-p-0") == "cmpl-p-2"  # prompt 2 of 3
    assert named_key("1_cmpl-d-2-99ff0011", "0_cmpl-p-0-a1b2c3d4") == "1_cmpl-p-2"  # n > 1
    assert named_key("chatcmpl-d-99ff0011", "chatcmpl-p") == "chatcmpl-p"
    assert named_key("cmpl-d-0-99ff0011", None) is None
    assert named_key("cmpl-d-0-99ff0011", "") is None


def test_precedence_transfer_id_then_remote_request_id_then_none() -> None:
    both = {**SIDE, "transfer_id": "T", "remote_request_id": "cmpl-p-0"}
    assert registration("cmpl-d-0-99ff0011", both, [[1]]).transfer_id == "T"
    named = {**SIDE, "remote_request_id": "cmpl-p-0"}
    assert registration("cmpl-d-0-99ff0011", named, [[1]]).transfer_id == "cmpl-p-0"
    assert registration("cmpl-d-0-99ff0011", dict(SIDE), [[1]]).transfer_id is None


def test_in_tree_names_of_sizes_and_engine() -> None:
    reg = registration("r", {**SIDE, "tp_size": 2, "pp_size": 3}, [[1]])
    assert (reg.remote_tp_size, reg.remote_pp_size) == (2, 3)
    mine = {**SIDE, "remote_tp_size": 4, "remote_pp_size": 1, "tp_size": 2, "pp_size": 3}
    reg = registration("r", mine, [[1]])  # kvpush's own names first
    assert (reg.remote_tp_size, reg.remote_pp_size) == (4, 1)
    assert registration("r", dict(SIDE), [[1]]).remote_engine_id == ANY_ENGINE
    assert not names_other_engine(ANY_ENGINE, "P") and not names_other_engine("prefill", "P")
    assert names_other_engine("Q", "P") and not names_other_engine("P", "P")


def test_p_answers_with_the_in_tree_names_too() -> None:
    """A proxy written for the in-tree connector builds D's leg from P's answer."""
    p = SchedulerSide("P", ConnectorOptions.parse({}, env={}), True, False, 2, pp_size=1)
    req = FakeRequest("cmpl-abc-0-a1b2c3d4", {"do_remote_decode": True})
    req.status = "FINISHED_LENGTH_CAPPED"
    _, params = p.request_finished(req, [1, 2])
    assert params is not None
    assert params["remote_request_id"] == "cmpl-abc-0-a1b2c3d4"
    assert (params["tp_size"], params["pp_size"], params["remote_engine_id"]) == (2, 1, "P")
    # D's leg made of that answer keys by the transfer id P minted: the same name.
    assert registration("cmpl-x-0-99ff0011", params, [[5]]).transfer_id == "cmpl-abc-0"


def test_match_table_finds_a_request_by_its_name_whatever_its_transfer_id() -> None:
    table: MatchTable[str] = MatchTable()
    table.add(Key("cmpl-p-0-a1b2c3d4", "T"), "p")
    assert table.find(Key("cmpl-d-0-99ff0011", "cmpl-p-0")) is None  # tids differ
    assert table.find_named("cmpl-p-0") == "p"
    assert table.find_named("cmpl-q-0") is None and table.find_named(None) is None
    assert table.pop_tid("T") == (Key("cmpl-p-0-a1b2c3d4", "T"), "p")
    assert len(table) == 0 and table.pop_tid("T") is None


@pytest.fixture
def make() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def build(**kw: object) -> Pair:
        pair = Pair(**kw)  # type: ignore[arg-type]
        made.append(pair)
        return pair

    yield build
    for pair in made:
        pair.close()


P_RID, D_RID = "cmpl-p-0-a1b2c3d4", "cmpl-d-0-99ff0011"


@pytest.mark.parametrize("p_first", [True, False], ids=["p-first", "d-first"])
@pytest.mark.parametrize("p_tid", ["cmpl-p-0", "T"], ids=["p-minted", "p-router-tid"])
def test_a_registration_naming_ps_request_pairs_in_both_orders(
    make: Callable[..., Pair], p_first: bool, p_tid: str
) -> None:
    """D's request has its own id and names P's (its key is P's name): pushed whether P's
    leg carried no transfer id (P's key is its name) or one (P finds it by its name)."""
    pair = make()
    if p_first:
        pair.p.prefill(P_RID, p_tid, 4)
        pair.until(lambda: len(pair.p.worker.producer.staged) == 1)
        pair.register(D_RID, "cmpl-p-0", 4)
    else:
        pair.register(D_RID, "cmpl-p-0", 4)
        pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1)
        pair.p.prefill(P_RID, p_tid, 4)
    # (the sim writes and checks bytes by each side's key: they differ under a router tid)
    done = (lambda: recv_ok(pair, D_RID)) if p_tid == "cmpl-p-0" else lambda: received(pair)
    pair.until(done, what="the receive")
    pair.until(lambda: "sent" in pair.p_kinds(P_RID), what="finished_sending on P")
    assert pair.p.worker.stats["reg_unpairable"] == 0
    pair.settle()


def received(pair: Pair) -> bool:
    return any(k == "recv" and r == D_RID and i["bytes"] > 0 for k, r, i in pair.d_events)


def test_a_registration_for_a_request_that_ended_fails_at_once(make: Callable[..., Pair]) -> None:
    """P pushed its request to one decoder request; a second naming it can never be
    served: P fails it now, not after registration_ttl_s (60 s here)."""
    pair = make(worker={"registration_ttl_s": 60.0})
    pair.p.prefill(P_RID, "T", 3)
    pair.register(D_RID, "T", 3)
    pair.until(lambda: "sent" in pair.p_kinds(P_RID), what="the first push")
    start = time.monotonic()
    pair.register("cmpl-d2-0-99ff0022", "cmpl-p-0", 3)  # by name, after it ended
    pair.register("cmpl-d3-0-99ff0033", "T", 3)  # by its transfer id
    pair.until(lambda: "failed" in pair.d_kinds("cmpl-d2-0-99ff0022"), what="D2 fails")
    pair.until(lambda: "failed" in pair.d_kinds("cmpl-d3-0-99ff0033"), what="D3 fails")
    assert time.monotonic() - start < 5
    assert pair.p.worker.stats["reg_unpairable"] == 2
    pair.settle()


def test_a_registration_waiting_for_a_request_that_ends_elsewhere_fails(
    make: Callable[..., Pair],
) -> None:
    """Two decoder requests name one P request before it comes: it is pushed to the first;
    the second is failed the moment it ends, not at its registration's expiry."""
    pair = make(worker={"registration_ttl_s": 60.0})
    pair.register(D_RID, "T", 3)
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1)
    pair.register("cmpl-d2-0-99ff0022", "cmpl-p-0", 3)  # waits under P's name
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 2)
    pair.p.prefill(P_RID, "T", 3)
    pair.until(lambda: recv_ok(pair, D_RID), what="the first push")
    pair.until(lambda: "failed" in pair.d_kinds("cmpl-d2-0-99ff0022"), timeout=5, what="D2")
    assert pair.p.worker.stats["reg_unpairable"] == 1
    pair.settle()


def test_a_registration_naming_another_engine_fails_at_once(make: Callable[..., Pair]) -> None:
    pair = make(worker={"registration_ttl_s": 60.0})
    pair.d.register(D_RID, "T", 3, "not-P", "127.0.0.1", pair.p.spec.port)  # type: ignore[arg-type]
    pair.until(lambda: "failed" in pair.d_kinds(D_RID), timeout=5, what="D fails")
    assert pair.p.worker.stats["reg_unpairable"] == 1
    assert len(pair.p.worker.producer.pending_regs) == 0
    pair.settle()


def test_a_decoder_named_as_the_prefiller_refuses_at_once(make: Callable[..., Pair]) -> None:
    """A decoder listed as a prefiller (a red-team run added one through the router's
    admin API): it refuses the registration now, instead of holding it until
    registration_ttl_s while its request waits (60 s)."""
    pair = make(worker={"registration_ttl_s": 60.0}, p_kw={"worker": {"prefiller": False}})
    start = time.monotonic()
    pair.register(D_RID, "T", 3)
    pair.until(lambda: "failed" in pair.d_kinds(D_RID), timeout=5, what="D fails")
    assert time.monotonic() - start < 5
    assert pair.p.worker.stats["reg_not_prefiller"] == 1
    assert len(pair.p.worker.producer.pending_regs) == 0
    pair.settle()


def test_the_in_tree_side_channel_environment_is_read_when_kvpushs_is_not_set() -> None:
    nixl = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5901"}
    opts = ConnectorOptions.parse({}, env=nixl)
    assert (opts.side_channel_host, opts.side_channel_port) == ("10.0.0.5", 5901)
    mine = {**nixl, "KVPUSH_SIDE_CHANNEL_PORT": "5700"}
    assert ConnectorOptions.parse({}, env=mine).side_channel_port == 5700  # kvpush's first
    assert ConnectorOptions.parse({"side_channel_port": 5800}, env=mine).side_channel_port == 5800


def test_registrations_waiting_for_prefills_hold_a_bounded_number_of_ids(
    make: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a shared secret any agent that fetched P's info can register: a red-team
    run's 3 MB registrations for made-up transfers grew P by 3 GiB in 30 s. Past
    MAX_PENDING_IDS waiting ids a registration is refused at once (D's request fails
    alone); the waiting ones are served, and room comes back as they leave."""
    monkeypatch.setattr(pairing, "MAX_PENDING_IDS", 7)
    pair = make(worker={"registration_ttl_s": 60.0})
    producer = pair.p.worker.producer
    pair.register(D_RID, "T1", 3)
    pair.register("cmpl-d2-0-99ff0022", "T2", 3)
    pair.until(lambda: len(producer.pending_regs) == 2)
    pair.register("cmpl-d3-0-99ff0033", "T3", 3)  # 9 ids > 7
    pair.until(lambda: "failed" in pair.d_kinds("cmpl-d3-0-99ff0033"), timeout=5, what="D3")
    assert pair.p.worker.stats["reg_over_budget"] == 1 and len(producer.pending_regs) == 2
    pair.p.prefill(P_RID, "T1", 3)  # a waiting one is served
    pair.until(lambda: recv_ok(pair, D_RID), what="the push of T1")
    pair.until(lambda: producer.pairing.pending_ids == 3, what="a recount")
    pair.register("cmpl-d4-0-99ff0044", "T4", 3)  # room again
    pair.until(lambda: len(producer.pending_regs) == 2, what="T4 to wait")
    assert pair.p.worker.stats["reg_over_budget"] == 1


def test_a_handshake_only_for_notices_is_no_push_failure(make: Callable[..., Pair]) -> None:
    """P handshakes with a registering D ahead of its push (and to send it notices). When
    that fails, no push failed: counted apart. A push that then waits on a handshake that
    fails is a push failure. (Seen in CI: after a cut link each notice's handshake failed
    at once, and push_failures counted the three cut pushes twice.)"""

    def unreachable(*args: Any, **kwargs: Any) -> Any:
        raise HandshakeError("no route to host")  # as after a cut link: at once

    pair = make(worker={"registration_ttl_s": 60.0}, p_fetch=unreachable)
    stats = pair.p.worker.stats
    pair.register(D_RID, "T", 3)
    pair.until(lambda: stats["notice_handshake_failed"] >= 1, what="the early handshake")
    assert stats["handshake_failed"] == 0
    pair.p.prefill(P_RID, "T", 3)
    pair.until(lambda: stats["handshake_failed"] == 1, what="the push's own handshake")
