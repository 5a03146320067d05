"""The router's pools changed without a restart (config file, admin endpoints) and its
settings checked; over real HTTP, against the fake upstreams of test_router_pools."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from unittest import mock

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from kvpush.router import RouterConfig, admin, cli, make_app
from kvpush.router.pool import InstanceSpec
from tests.unit.test_router import serve
from tests.unit.test_router_pools import FAST, Fake, complete, instances, until

UNUSABLE_URLS = [
    "http://",
    "http://a b/",
    "http://[::1",
    "http://x:99999",
    "http://h\r\nX-Evil: 1",
    "http://bad\ud800host",
    "http://" + "a" * 3000,
]


def test_config_file_reload_and_admin_input_checks(tmp_path: Path) -> None:
    async def main() -> None:
        prefilled: dict[str, asyncio.Event] = {}
        p = await Fake("p0", "prefill", prefilled).start()
        d0 = await Fake("d0", "decode", prefilled).start()
        d1 = await Fake("d1", "decode", prefilled).start()
        path = tmp_path / "pools.json"
        path.write_text(json.dumps({"prefill": [p.url], "decode": [{"url": d0.url}]}))
        cfg = RouterConfig(config_path=str(path), admin_token="s3cret", **FAST)
        router, url = await serve(make_app(cfg), handler_cancellation=True)
        auth = {"Authorization": "Bearer s3cret", "Content-Type": "application/json"}
        try:
            async with aiohttp.ClientSession(headers=auth) as cl:
                assert set(await instances(cl, url)) == {p.url, d0.url}
                assert (await complete(cl, url))[1]["choices"][0]["text"] == "d0"
                # d0 drained and d1 added by editing the file: picked up without a restart.
                path.write_text(
                    json.dumps(
                        {
                            "prefill": [p.url],
                            "decode": [{"url": d0.url, "drain": True}, {"url": d1.url}],
                        }
                    )
                )

                async def reloaded() -> bool:
                    return d1.url in await instances(cl, url)

                await until(reloaded, "the file re-read")
                assert (await instances(cl, url))[d0.url]["draining"] is True
                assert (await complete(cl, url))[1]["choices"][0]["text"] == "d1"
                # A bad file changes nothing.
                path.write_text('{"decode": [{"url": "ftp://x"}]}')
                async with cl.post(url + "/admin/reload") as resp:
                    assert resp.status == 400 and "url" in (await resp.json())["error"]["message"]
                assert set(await instances(cl, url)) == {p.url, d0.url, d1.url}
                for bad in (b"{nope", b"[]", b'{"role": "x", "url": "http://a"}'):
                    async with cl.post(url + "/admin/instances", data=bad) as resp:
                        assert resp.status == 400, bad
                body = {"role": "decode", "url": "http://a:1", "extra": 1}
                async with cl.post(url + "/admin/instances", json=body) as resp:
                    assert resp.status == 400
                # URLs no request could be sent to (a red-team run added them all; the lone
                # surrogate failed every client's request with a 500 until health caught up).
                for bad_url in UNUSABLE_URLS:
                    body = {"role": "decode", "url": bad_url}
                    async with cl.post(url + "/admin/instances", json=body) as resp:
                        assert resp.status == 400, bad_url
                body = {"role": "decode", "url": "http://a:1", "side_channel": "[]:80"}
                async with cl.post(url + "/admin/instances", json=body) as resp:
                    assert resp.status == 400
                assert (await complete(cl, url))[0] == 200
                async with cl.post(url + "/admin/drain", json={"role": "decode", "url": "x"}) as r:
                    assert r.status == 404
                assert set(await instances(cl, url)) == {p.url, d0.url, d1.url}
            async with aiohttp.ClientSession() as anon:
                async with anon.get(url + "/admin/instances") as resp:
                    assert resp.status == 401
                async with anon.get(url + "/metrics") as resp:
                    text = await resp.text()
            assert "kvpush_router_request_latency_seconds_bucket" in text
            assert f'instance="{d1.url}"' in text
        finally:
            await router.cleanup()
            for fake in (p, d0, d1):
                assert fake.runner is not None
                await fake.runner.cleanup()

    asyncio.run(main())


def test_flags_and_settings_are_checked() -> None:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        "router --port 1 --prefill http://a:1/ --prefill-side-channel a:5 "
        "--prefill http://b:1 --prefill-side-channel b:5 --decode http://c:1".split()
    )
    assert cli.instances(args) == (
        InstanceSpec("prefill", "http://a:1", ("a", 5)),
        InstanceSpec("prefill", "http://b:1", ("b", 5)),
        InstanceSpec("decode", "http://c:1"),
    )
    for bad in (
        "router --port 1 --prefill http://a --prefill http://b --prefill-side-channel a:5 "
        "--decode http://c",
        "router --port 1 --prefill http://a",
    ):
        with pytest.raises(ValueError):
            cli.instances(parser.parse_args(bad.split()))
    for settings in ({"retries": -1}, {"health_interval": 0}, {"health_passes": 0}):
        with pytest.raises(ValueError):
            RouterConfig("http://a", "http://b", **settings)
    with pytest.raises(ValueError):
        make_app(RouterConfig())


JSON = {"Content-Type": "application/json"}
TOKEN = {"Authorization": "Bearer s3cret"}


@pytest.mark.parametrize(
    ("token", "loopback_open", "remote", "method", "headers", "status"),
    [
        # Without a token the admin endpoints are off, unless opened to loopback.
        (None, False, "127.0.0.1", "GET", {}, 403),
        (None, True, "127.0.0.1", "GET", {}, None),
        (None, True, "::1", "GET", {"Host": "[::1]:8000"}, None),
        (None, True, "::ffff:127.0.0.1", "GET", {"Host": "localhost:8000"}, None),
        (None, True, "10.0.0.7", "GET", {}, 403),  # not loopback
        # A page whose name was rebound to 127.0.0.1 names the router by its own name.
        (None, True, "127.0.0.1", "GET", {"Host": "evil.example:8000"}, 403),
        ("s3cret", False, "10.0.0.7", "GET", TOKEN, None),
        ("s3cret", False, "127.0.0.1", "GET", {}, 401),  # a token set binds loopback too
        ("s3cret", False, "10.0.0.7", "GET", {"Authorization": "Bearer nope"}, 401),
        ("s3cret", False, "10.0.0.7", "GET", {"Authorization": "Bearer s3cret2"}, 401),
        ("s3cret", False, "10.0.0.7", "GET", {"Authorization": "Bearer s3cr\u20ac"}, 401),
        # A body only as JSON: a page can post a form or text anywhere, JSON not.
        ("s3cret", False, "10.0.0.7", "POST", {**TOKEN, **JSON}, None),
        ("s3cret", False, "10.0.0.7", "POST", {**TOKEN, "Content-Type": "text/plain"}, 415),
        ("s3cret", False, "10.0.0.7", "DELETE", TOKEN, 415),
        (
            None,
            True,
            "127.0.0.1",
            "POST",
            {"Content-Type": "application/x-www-form-urlencoded"},
            415,
        ),
        # Another site's page, token or not.
        ("s3cret", False, "10.0.0.7", "GET", {**TOKEN, "Origin": "http://evil.example"}, 403),
        (None, True, "127.0.0.1", "POST", {**JSON, "Origin": "http://evil.example"}, 403),
        (None, True, "127.0.0.1", "POST", {**JSON, "Origin": "null"}, 403),
        (None, True, "127.0.0.1", "POST", {**JSON, "Origin": "http://127.0.0.1:8000"}, None),
    ],
)
def test_admin_refusals(
    token: str | None,
    loopback_open: bool,
    remote: str,
    method: str,
    headers: dict[str, str],
    status: int | None,
) -> None:
    cfg = RouterConfig(
        prefill_url="http://p:1",
        decode_url="http://d:1",
        admin_token=token,
        admin_loopback_open=loopback_open,
    )
    app = make_app(cfg)
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda k, d=None: (remote, 5) if k == "peername" else d
    headers = {"Host": "127.0.0.1:8000", **headers}
    req = make_mocked_request(
        method, "/admin/instances", headers=headers, app=app, transport=transport
    )
    got = admin.refusal(req)
    assert (got.status if got is not None else None) == status


def test_admin_token_is_compared_in_constant_time() -> None:
    app = make_app(RouterConfig(prefill_url="http://p:1", decode_url="http://d:1", admin_token="t"))
    req = make_mocked_request("GET", "/admin/instances", headers=TOKEN, app=app)
    with mock.patch.object(admin.hmac, "compare_digest", return_value=True) as compare:
        assert admin.refusal(req) is None  # the comparison decided, not ==
    compare.assert_called_once()


def test_boundary_flags_reach_the_routers_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    monkeypatch.delenv("KVPUSH_ROUTER_ADMIN_TOKEN", raising=False)
    cli.add_parser(parser.add_subparsers())
    base = "router --port 1 --prefill http://a:1 --decode http://c:1"
    cfg = cli.config(parser.parse_args(base.split()))
    # The defaults: admin off, a cap, a body limit and a read deadline.
    assert cfg.admin_token is None and cfg.admin_loopback_open is False
    assert (cfg.max_concurrent, cfg.max_body_bytes, cfg.body_timeout) == (1024, 64 << 20, 30.0)
    more = " --admin-loopback-without-token --max-concurrent-requests 7 --max-body-bytes 99"
    cfg = cli.config(parser.parse_args((base + more + " --body-timeout 2.5").split()))
    assert cfg.admin_loopback_open is True
    assert (cfg.max_concurrent, cfg.max_body_bytes, cfg.body_timeout) == (7, 99, 2.5)
    for bad in ("--max-concurrent-requests 0", "--body-timeout 0", "--admin-token \u20ac"):
        with pytest.raises(ValueError):
            cli.config(parser.parse_args([*base.split(), *bad.split()]))
