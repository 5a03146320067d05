"""P pushes only to trusted decoders: an allowlist and a shared secret proven at handshake;
with a secret only agents that proved it are heard; the secret shows nowhere."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpush.core import wire
from kvpush.core.memory_transport import MemoryTransport
from kvpush.core.types import WorkerConfig
from kvpush.vllm.config import ENV_SECRET, ConnectorOptions
from tests.unit.test_push_states import Pair, recv_ok


@pytest.fixture
def make() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def build(p_worker: dict[str, Any], d_worker: dict[str, Any], **kw: Any) -> Pair:
        pair = Pair(p_kw={"worker": p_worker}, d_kw={"worker": d_worker}, **kw)
        made.append(pair)
        return pair

    yield build
    for pair in made:
        pair.close()


def push(pair: Pair) -> None:
    pair.p.prefill("p1", "t1", 3)
    pair.register("d1", "t1", 3)


def test_untrusted_decoder_is_refused_and_nothing_written(make: Callable[..., Pair]) -> None:
    pair = make({"trusted_decoders": frozenset({"127.0.0.1:1"})}, {}, watchdog_s=0.5)
    push(pair)
    pair.until(lambda: pair.p.worker.stats["reg_untrusted"] >= 1, what="refusal")
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="D gives up")
    assert pair.p.worker.stats["writes"] == 0
    assert pair.p.worker.stats["handshakes"] == 0  # P never contacted the named decoder


def test_trusted_decoder_is_served(make: Callable[..., Pair]) -> None:
    built = make({}, {})
    d_where = f"127.0.0.1:{built.d.spec.port}"
    built.p.worker.config.trusted_decoders = frozenset({d_where})
    push(built)
    built.until(lambda: recv_ok(built, "d1"), what="push to the trusted decoder")
    assert built.p.worker.stats["reg_untrusted"] == 0


def test_shared_secret_accepted(make: Callable[..., Pair]) -> None:
    pair = make({"shared_secret": b"s3cret"}, {"shared_secret": b"s3cret"})
    push(pair)
    pair.until(lambda: recv_ok(pair, "d1"), what="push with a shared secret")


@pytest.mark.parametrize("d_secret", [b"other", None], ids=["wrong-secret", "no-secret"])
def test_decoder_without_the_secret_gets_nothing(
    make: Callable[..., Pair], d_secret: bytes | None
) -> None:
    pair = make({"shared_secret": b"s3cret"}, {"shared_secret": d_secret}, watchdog_s=0.5)
    push(pair)
    pair.until(lambda: "failed" in pair.d_kinds("d1"), what="D fails")
    assert pair.p.worker.stats["writes"] == 0
    assert pair.p.worker.stats["handshake_failed"] + pair.d.worker.stats["handshake_failed"] >= 1


def rogue_on(pair: Pair, *targets: str) -> MemoryTransport:
    """An agent on the fabric that knows the targets' names (as if their metadata leaked)
    but never completed a handshake with them."""
    rogue = MemoryTransport(pair.fabric, "rogue-tp0-00000000")
    for name in targets:
        rogue.add_peer(name, name.encode())
    return rogue


def forged_reg(pair: Pair, rid: str, tid: str) -> bytes:
    return wire.encode(
        wire.PushReg(
            request_id=rid,
            decode_engine_id="D",
            decode_host="127.0.0.1",
            decode_port=pair.d.spec.port,
            decode_tp_size=1,
            local_block_ids=[[0, 1, 2]],
            remote_engine_id="P",
            remote_host="127.0.0.1",
            remote_port=pair.p.spec.port,
            remote_tp_size=1,
            transfer_id=tid,
        )
    )


def test_notifications_from_unauthenticated_agents_are_dropped(make: Callable[..., Pair]) -> None:
    pair = make({"shared_secret": b"s3cret"}, {"shared_secret": b"s3cret"})
    p_agent, d_agent = pair.p.worker.info.agent_name, pair.d.worker.info.agent_name
    rogue = rogue_on(pair, p_agent, d_agent)
    pair.register("d1", "t1", 3)  # D handshakes with P, then registers
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1, what="D's registration")
    # Before P's prefill ends, the rogue claims the same transfer (it would take D's place),
    # renews nothing, cancels, and tells D its KV arrived.
    rogue.send_notif(p_agent, forged_reg(pair, "rogue-1", "t1"))
    rogue.send_notif(p_agent, wire.encode(wire.Heartbeat(entries=[wire.HbEntry("d1", "t1")])))
    rogue.send_notif(p_agent, wire.encode(wire.PushCancel(request_id="d1", transfer_id="t1")))
    rogue.send_notif(d_agent, wire.encode_completion("d1", 1))
    rogue.send_notif(d_agent, wire.encode(wire.PushFail(request_id="d1", reason="forged")))
    pair.until(
        lambda: (
            pair.p.worker.stats["notif_unauthenticated"] == 3
            and pair.d.worker.stats["notif_unauthenticated"] == 2
        ),
        what="the forged notifications dropped",
    )
    assert not pair.d_kinds("d1")  # neither completed nor failed by the rogue
    group = next(iter(pair.p.worker.producer.pending_regs.values()))
    assert [p.sender for p in group.regs.values()] == [d_agent]
    assert not pair.p.worker.producer.gone
    pair.p.prefill("p1", "t1", 3)
    pair.until(lambda: recv_ok(pair, "d1"), what="the honest push")
    assert d_agent in pair.p.worker.peers.authenticated
    assert p_agent in pair.d.worker.peers.authenticated
    assert "rogue-tp0-00000000" not in pair.p.worker.peers.authenticated


def test_without_a_secret_notifications_are_acted_on_as_before(make: Callable[..., Pair]) -> None:
    pair = make({}, {})
    rogue = rogue_on(pair, pair.p.worker.info.agent_name)
    rogue.send_notif(pair.p.worker.info.agent_name, forged_reg(pair, "r1", "t9"))
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1, what="kept")
    assert pair.p.worker.stats["notif_unauthenticated"] == 0


def test_the_secret_is_in_no_repr() -> None:
    opts = ConnectorOptions.parse({}, env={ENV_SECRET: "hunter2-hunter2"})
    cfg = WorkerConfig(engine_id="e", shared_secret=opts.secret)
    shown = [repr(opts), str(opts), repr(cfg), f"{cfg}", f"{opts.secret}", str(opts.secret)]
    shown.append(repr(dataclasses.asdict(cfg)))
    assert not any("hunter2" in s for s in shown), shown
    assert opts.secret == b"hunter2-hunter2" and cfg.shared_secret == opts.secret
    assert WorkerConfig(engine_id="e", shared_secret=b"").shared_secret is None
    assert pickle.loads(pickle.dumps(cfg)).shared_secret == b"hunter2-hunter2"
