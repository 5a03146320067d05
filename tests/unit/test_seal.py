"""Sealed kv_transfer_params (`kvpush.core.seal`): with a params secret the router seals
each leg's params, and P and D act only on sealed ones; a client that reaches them
directly is served as by a plain server (P holds no blocks for it, D computes its prompt)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from aiohttp import web

from kvpush.core import seal
from kvpush.core.errors import ConfigError
from kvpush.core.secret import Secret
from kvpush.router import RouterConfig
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.scheduler_side import SchedulerSide
from tests.unit.test_router import completion_body, running
from tests.unit.test_vllm_adapter import FakeRequest

KEY = Secret("params-secret-of-the-tests")
P_LEG = {"do_remote_decode": True, "transfer_id": "T"}
D_LEG = {
    "do_remote_prefill": True,
    "transfer_id": "T",
    "remote_host": "127.0.0.1",
    "remote_port": 5700,
}


def test_a_seal_covers_every_key_and_value() -> None:
    sealed = seal.seal(D_LEG, KEY)
    assert seal.sealed(sealed, KEY)
    assert not seal.sealed(sealed, Secret("another secret"))
    assert not seal.sealed(D_LEG, KEY)  # none
    for key in D_LEG:
        changed = {**sealed, key: "x"}
        assert not seal.sealed(changed, KEY), key
        less = {k: v for k, v in sealed.items() if k != key}
        assert not seal.sealed(less, KEY), key
    assert not seal.sealed({**sealed, "remote_port": 5700.0}, KEY)
    assert not seal.sealed({**sealed, "do_remote_prefill": 1}, KEY)  # true is not 1
    assert not seal.sealed({**sealed, "more": 1}, KEY)
    # The connector's own marks, added after the check, are not covered.
    assert seal.sealed({**sealed, "_kvpush_registered": "abc"}, KEY)


@pytest.mark.parametrize(
    "params",
    [
        {**D_LEG, "kvpush_seal": 5},
        {**D_LEG, "kvpush_seal": "0" * 63},
        {**D_LEG, "nested": {"a": 1}},
        {**D_LEG, "list": [1, 2]},
        {**D_LEG, "long": "x" * 2000},
        {f"k{i}": i for i in range(100)},
        {**D_LEG, "nan": math.nan},
    ],
)
def test_params_no_router_could_have_sealed_are_refused_before_hashing(params: Any) -> None:
    assert not seal.sealed(params, KEY)
    if not seal.flat(params):
        with pytest.raises(ValueError):
            seal.seal(params, KEY)


def test_the_secret_comes_from_the_environment_only() -> None:
    assert seal.from_env({}) is None and seal.from_env({seal.ENV: ""}) is None
    assert seal.from_env({seal.ENV: "s3cr3t"}) == Secret("s3cr3t")
    opts = ConnectorOptions.parse({}, env={seal.ENV: "s3cr3t"})
    assert opts.params_secret == Secret("s3cr3t") and "s3cr3t" not in repr(opts)
    with pytest.raises(ConfigError):  # not a config key: vLLM logs configs
        ConnectorOptions.parse({"params_secret": "s"}, env={})


def sides(secret: Secret | None) -> tuple[SchedulerSide, SchedulerSide]:
    env = {seal.ENV: secret.reveal().decode()} if secret is not None else {}
    opts = ConnectorOptions.parse({}, env=env)
    return SchedulerSide("P", opts, True, False, 1), SchedulerSide("D", opts, False, True, 1)


@pytest.mark.parametrize("secret", [KEY, None], ids=["secret", "none"])
def test_p_and_d_act_only_on_sealed_params_when_they_have_the_secret(
    secret: Secret | None,
) -> None:
    p, d = sides(secret)
    for params, acted in ((P_LEG, secret is None), (seal.seal(P_LEG, KEY), True)):
        req = FakeRequest("cmpl-a-0-a1b2c3d4", dict(params))
        req.status = "FINISHED_LENGTH_CAPPED"
        p.on_new_request(req)
        held, out = p.request_finished(req, [1, 2])
        assert held is acted and (out is not None) is acted, params
    for i, (params, acted) in enumerate(((D_LEG, secret is None), (seal.seal(D_LEG, KEY), True))):
        req = FakeRequest(f"cmpl-b{i}-0-99ff0011", dict(params))
        assert d.get_num_new_matched_tokens(req, 0)[1] is acted, params
        d.update_state_after_alloc(req, ([5, 6, 7],), 300 if acted else 0, block_size=128)
        registered = d.sched.build_meta().registrations
        assert [r.transfer_id for r in registered] == (["T"] if acted else []), params
    # Params that ask for nothing are no one's concern (and not logged).
    for other in ({}, {"other": 1}, {"do_remote_prefill": False}):
        assert d._params(FakeRequest("cmpl-o-0-99ff0011", dict(other))) == other
    # The verdict is kept in the params: an unsealed request is checked (and logged) once.
    assert (p._unsealed, d._unsealed) == ((1, 1) if secret is not None else (0, 0))
    if secret is not None:  # a client's guess at the verdict's mark changes nothing
        forged = FakeRequest("cmpl-c-0-99ff0011", {**D_LEG, "_kvpush_sealed": "x" * 32})
        assert d.get_num_new_matched_tokens(forged, 0) == (0, False)


def test_the_router_seals_both_legs() -> None:
    seen: dict[str, dict[str, Any]] = {}

    async def prefill(request: web.Request) -> web.Response:
        seen["p"] = (await request.json())["kv_transfer_params"]
        return web.json_response({"choices": [{"text": "P"}]})

    async def decode(request: web.Request) -> web.Response:
        seen["d"] = (await request.json())["kv_transfer_params"]
        return web.json_response({"choices": [{"text": "D"}]})

    p_app, d_app = web.Application(), web.Application()
    p_app.router.add_post("/v1/completions", prefill)
    d_app.router.add_post("/v1/completions", decode)

    async def main() -> None:
        extra = {"remote_engine_id": "prefill"}
        async with running(p_app, d_app, params_secret=KEY, decode_kv_extra=extra) as (url, cl):
            async with cl.post(url + "/v1/completions", json=completion_body()) as resp:
                assert resp.status == 200

    asyncio.run(main())
    assert seal.sealed(seen["p"], KEY) and seen["p"]["do_remote_decode"] is True
    assert seal.sealed(seen["d"], KEY) and seen["d"]["remote_engine_id"] == "prefill"
    with pytest.raises(ValueError):  # what the router could not seal is refused at start
        RouterConfig("http://p:1", "http://d:1", params_secret=KEY, decode_kv_extra={"a": [1]})
