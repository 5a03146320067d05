"""Fuzzing the wire decoder and the notification handlers of live workers."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core import wire
from kvpush.core.errors import WireError
from kvpush_bench.sim import fuzz_cli
from kvpush_bench.sim.fuzz import FuzzOptions, FuzzTarget, decode_outcome
from kvpush_bench.sim.fuzz_inputs import PREFIXES, Generator

prefix = st.sampled_from(PREFIXES)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
names = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=30
)


def packed(v: Any) -> bytes:
    return msgspec.msgpack.encode(v)


def reg_dicts() -> st.SearchStrategy[dict[str, Any]]:
    """PUSH_REG-shaped dicts with any field possibly out of type or range."""
    ints = st.integers(min_value=-(2**40), max_value=2**40)
    return st.fixed_dictionaries(
        {
            "request_id": names | st.text(max_size=3),
            "decode_engine_id": names,
            "decode_host": st.sampled_from(["127.0.0.1", "", "::1"]),
            "decode_port": ints,
            "decode_tp_size": ints,
            "local_block_ids": st.lists(st.lists(ints, max_size=8), max_size=3),
            "remote_engine_id": names,
            "remote_host": st.just("127.0.0.1"),
            "remote_port": ints,
            "remote_tp_size": ints,
        },
        optional={"transfer_id": names | st.none(), "decode_tp_rank": ints, "x": values},
    )


@given(st.binary(max_size=300))
def test_decode_random_bytes(raw: bytes) -> None:
    assert decode_outcome(raw) in ("accepted", "rejected")


@given(prefix, st.binary(max_size=300))
def test_decode_prefixed_bytes(pre: bytes, raw: bytes) -> None:
    assert decode_outcome(pre + raw) in ("accepted", "rejected")


@given(prefix, values)
def test_decode_prefixed_msgpack(pre: bytes, v: Any) -> None:
    assert decode_outcome(pre + packed(v)) in ("accepted", "rejected")


@given(reg_dicts())
def test_decoded_registrations_hold_their_bounds(d: dict[str, Any]) -> None:
    try:
        msg = wire.decode(wire.REG_PREFIX + packed(d))
    except WireError:
        return
    assert isinstance(msg, wire.PushReg)
    ids = [i for g in msg.local_block_ids for i in g]
    assert ids and all(0 <= i <= wire.MAX_BLOCK_ID for i in ids)
    assert all(len(set(g)) == len(g) for g in msg.local_block_ids)
    assert 1 <= msg.decode_port <= 65535 and 0 <= msg.decode_tp_rank < msg.decode_tp_size


@given(names, st.integers(min_value=1, max_value=wire.MAX_TP))
def test_completion_round_trip(rid: str, tp: int) -> None:
    if rid.startswith("PUSH_"):
        return
    assert wire.decode(wire.encode(wire.Completion(rid, tp))) == wire.Completion(rid, tp)


# ---- live workers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Iterator[FuzzTarget]:
    t = FuzzTarget(FuzzOptions(staged=4, receiving=4))
    yield t
    t.close()


def healthy(t: FuzzTarget) -> None:
    assert t.writes() == 0 and t.stat("writer_errors") == 0 and t.writers_alive()
    assert not t.crashes


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from("PD"),
            st.sampled_from(["peer", "stranger"]),
            prefix.flatmap(
                lambda p: st.one_of(
                    values.map(lambda v: p + packed(v)),
                    reg_dicts().map(lambda d: wire.REG_PREFIX + packed(d)),
                )
            )
            | st.binary(max_size=80),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_hypothesis_inputs_through_live_workers(target: FuzzTarget, items: list[Any]) -> None:
    w = target.world
    batch = []
    for dest, who, raw in items:
        peer = w.d_agent if dest == "P" else w.p_agent
        batch.append((dest, peer if who == "peer" else "stranger", raw))
    target.deliver(batch)
    healthy(target)


def test_generated_inputs_through_live_workers(target: FuzzTarget) -> None:
    gen = Generator(target.world, random.Random(5))
    seen: set[str] = set()
    for _ in range(6):
        batch = []
        for _ in range(300):
            cat, dest, sender, raw = gen.next()
            seen.add(cat)
            batch.append((dest, sender, raw))
        target.deliver(batch)
        healthy(target)
    assert {"registration", "completion", "random_bytes", "corrupted_valid"} <= seen
    assert target.stat("rejected") > 0 and target.stat("reg_invalid") > 0


def test_the_harness_sees_a_write() -> None:
    """A valid registration from D for staged blocks is written: writes_caused can fail."""
    t = FuzzTarget(FuzzOptions(staged=1, receiving=1))
    try:
        w = t.world
        reg = wire.PushReg(
            request_id="legit",
            decode_engine_id="fuzzD",
            decode_host="127.0.0.1",
            decode_port=w.d_port,
            decode_tp_size=1,
            local_block_ids=[[60, 61, 62, 63]],
            remote_engine_id="fuzzP",
            remote_host="127.0.0.1",
            remote_port=w.p_port,
            remote_tp_size=1,
            transfer_id=w.staged_tids[0],
        )
        t.deliver([("P", w.d_agent, wire.encode(reg))])
        t.drain()
        assert t.writes() == 1 and t.write_samples() == ["b'legit:1'"]
    finally:
        t.close()


def test_fuzz_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    fuzz_cli.add_parser(parser.add_subparsers())
    doc = tmp_path / "reliability.md"
    args = parser.parse_args(
        ["fuzz", "--inputs", "3000", "--seed", "11", "--json", "--doc", str(doc)]
    )
    assert args.func(args) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["inputs"] == 3000 and s["crashes"] == 0 and s["writes_caused"] == 0
    assert 0 < s["rejected"] < 3000 and s["ignored"] > 0 and s["writers_alive"]
    assert f"| 3000 | {s['rejected']} |" in doc.read_text()
