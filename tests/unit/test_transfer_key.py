"""The connector's per-sub-request transfer keys: the same on P and D for each engine
request vLLM makes of one client request, and distinct between them."""

from __future__ import annotations

import itertools

from kvpush.vllm.scheduler_side import transfer_key


def engine_ids(rid: str, prompts: int, n: int, suffix: str, chat: bool) -> list[str]:
    """The engine request ids vLLM 0.32 gives one client request (see its serving code)."""
    out = []
    for i in range(prompts):
        if chat:
            base = f"chatcmpl-{rid}" if prompts == 1 else f"chatcmpl-{rid}_{i}"
        else:
            base = f"cmpl-{rid}-{i}"
        parent = f"{base}-{suffix}"
        out += [parent] if n == 1 else [f"{j}_{parent}" for j in range(n)]
    return out


def test_keys_pair_each_sub_request_and_no_other() -> None:
    rid = "0123456789abcdef0123456789abcdef"  # the router's id, as in X-Request-Id
    for prompts, n, chat in itertools.product((1, 3), (1, 4), (False, True)):
        p_ids = engine_ids(rid, prompts, n, "a1b2c3d4", chat)
        d_ids = engine_ids(rid, prompts, n, "99ff0011", chat)
        p_keys = [transfer_key(r, "T") for r in p_ids]
        d_keys = [transfer_key(r, "T") for r in d_ids]
        assert p_keys == d_keys
        assert len(set(p_keys)) == prompts * n
        assert p_keys[0] == "T"  # a single request keeps the router's transfer id


def test_no_transfer_id_no_key() -> None:
    assert transfer_key("cmpl-x-1-a1b2c3d4", None) is None
    assert transfer_key("cmpl-x-1-a1b2c3d4", "") is None
    assert transfer_key("r1", "T") == "T"  # ids of other shapes: the bare transfer id


def test_both_sides_key_each_sub_request_of_one_client_request() -> None:
    """P's finished prefills and D's registrations carry the same per-sub-request key."""
    from kvpush.vllm.config import ConnectorOptions
    from kvpush.vllm.scheduler_side import SchedulerSide
    from tests.unit.test_vllm_adapter import FakeRequest

    opts = ConnectorOptions.parse({}, env={})  # (request_finished: no early hand-over)
    p = SchedulerSide("P", opts, True, False, 1)
    d = SchedulerSide("D", opts, False, True, 1)
    side = {"remote_host": "127.0.0.1", "remote_port": 5700}
    for rid in engine_ids("abc", 2, 2, "a1b2c3d4", chat=False):
        params = {"do_remote_decode": True, "transfer_id": "T"}
        p.request_finished(FakeRequest(rid, params), [1])
    for rid in engine_ids("abc", 2, 2, "99ff0011", chat=False):
        req = FakeRequest(rid, {"do_remote_prefill": True, "transfer_id": "T", **side})
        d.update_state_after_alloc(req, ([5, 6, 7],), 300, block_size=128)
    sent = [s.transfer_id for s in p.sched.build_meta().finished]
    registered = [r.transfer_id for r in d.sched.build_meta().registrations]
    assert sent == registered == ["T", "T:0:1", "T:1:0", "T:1:1"]


def test_p_mints_a_key_when_the_request_carried_none() -> None:
    """Behind a proxy that sends the legs in turn (vllm-router): P keys the transfer by its
    request id without the engine suffix and returns that key, and D's registration made
    from P's answer carries it, whatever request id D was given."""
    from kvpush.vllm.config import ConnectorOptions
    from kvpush.vllm.scheduler_side import SchedulerSide
    from tests.unit.test_vllm_adapter import FakeRequest

    opts = ConnectorOptions.parse({}, env={})
    p = SchedulerSide("P", opts, True, False, 1)
    d = SchedulerSide("D", opts, False, True, 1)
    req = FakeRequest("cmpl-abc-0-a1b2c3d4", {"do_remote_decode": True})
    req.status = "FINISHED_LENGTH_CAPPED"
    held, params = p.request_finished(req, [1, 2])
    assert held and params is not None and params["transfer_id"] == "cmpl-abc-0"
    assert [s.transfer_id for s in p.sched.build_meta().finished] == ["cmpl-abc-0"]
    d.update_state_after_alloc(FakeRequest("cmpl-other-0-99ff0011", params), ([5, 6],), 200, 128)
    assert [r.transfer_id for r in d.sched.build_meta().registrations] == ["cmpl-abc-0"]
