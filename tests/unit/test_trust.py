"""P pushes only to trusted decoders: an allowlist and a shared secret proven at handshake."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

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
