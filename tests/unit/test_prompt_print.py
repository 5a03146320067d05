"""The prompt print (issue 37): D's registration names the prompt D computed (token count
and a digest of its token ids); P refuses to push into a registration of another prompt,
tells D why (PUSH_FAIL with cause ``prompt_mismatch``) and counts it; D fails the receive
under that cause. Wire checks, then the state machines over the in-memory transport, then
the vLLM scheduler side that computes the prints."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvpush.core import wire
from kvpush.core.errors import WireError
from kvpush.vllm.scheduler_side import prompt_print
from tests.unit.test_push_states import Pair, recv_ok
from tests.unit.test_vllm_adapter import FakeRequest, NewReq, SchedOut, sides
from tests.unit.test_wire import make_reg

PROMPT = list(range(40, 340))
MINE = wire.fingerprint(PROMPT)
SAME_LENGTH = wire.fingerprint([*PROMPT[:-1], 7])  # one token differs (a special token, say)
LONGER = wire.fingerprint([1, 2, 3, *PROMPT])  # another chat template's preamble


# ---- wire ----------------------------------------------------------------------------------


def test_fingerprint_is_blake2b_of_the_int64_ids() -> None:
    want = hashlib.blake2b(struct.pack("<3q", 5, 0, 1023), digest_size=16).digest()
    assert wire.fingerprint([5, 0, 1023]) == wire.PromptPrint(3, want)
    assert wire.fingerprint(PROMPT) == MINE  # the same ids, the same print
    assert len({MINE, SAME_LENGTH, LONGER, wire.fingerprint(PROMPT[::-1])}) == 4
    assert wire.fingerprint([]).tokens == 0
    with pytest.raises(ValueError):
        wire.fingerprint([[1, 2], [3, 4]])  # type: ignore[list-item]


def test_registration_carries_the_print_and_stays_seed_compatible() -> None:
    reg = make_reg(prompt=MINE)
    got = wire.decode(wire.encode(reg))
    assert got == reg and isinstance(got, wire.PushReg) and got.prompt == MINE
    body = msgspec.msgpack.decode(wire.encode(reg)[len(wire.REG_PREFIX) :])
    assert body["prompt"] == [300, MINE.digest]  # two fields, in a fixed order
    # Without a print nothing is encoded (the seed's registration), and none is decoded.
    plain = msgspec.msgpack.decode(wire.encode(make_reg())[len(wire.REG_PREFIX) :])
    assert "prompt" not in plain
    assert wire.decode(wire.encode(make_reg())).prompt is msgspec.UNSET  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [
        None,
        "abc",
        300,
        {"tokens": 300, "digest": b"x" * 16},
        [300],
        [300, b"x" * 16, 1],  # longer than the two fields
        [300, b"x" * 15],
        [300, b"x" * 17],
        [300, b""],
        [300, "x" * 16],  # a str where bytes belong
        [-1, b"x" * 16],
        [2**31, b"x" * 16],
        [2**64 - 1, b"x" * 16],
        [True, b"x" * 16],
        [1.5, b"x" * 16],
        [None, b"x" * 16],
    ],
)
def test_hostile_prints_are_refused(value: Any) -> None:
    body = msgspec.msgpack.decode(wire.encode(make_reg())[len(wire.REG_PREFIX) :])
    body["prompt"] = value
    with pytest.raises(WireError, match="bad PUSH_REG"):
        wire.decode(wire.REG_PREFIX + msgspec.msgpack.encode(body))


def test_push_fail_cause_round_trips_and_is_checked() -> None:
    fail = wire.PushFail(request_id="r", reason="x", cause=wire.CAUSE_PROMPT_MISMATCH)
    assert wire.decode(wire.encode(fail)) == fail
    plain = wire.PushFail(request_id="r", reason="x")  # no cause: as before, not encoded
    assert b"cause" not in wire.encode(plain) and wire.decode(wire.encode(plain)) == plain
    body = msgspec.msgpack.decode(wire.encode(fail)[len(wire.FAIL_PREFIX) :])
    for bad in ["", "Prompt", "a b", "x" * 65, 7, None, ["prompt_mismatch"]]:
        body["cause"] = bad
        with pytest.raises(WireError, match="bad PUSH_FAIL"):
            wire.decode(wire.FAIL_PREFIX + msgspec.msgpack.encode(body))


# ---- the state machines --------------------------------------------------------------------


def refused(pair: Pair, rid: str) -> str:
    """D's reason for failing ``rid`` ("" until it did)."""
    reasons = [i["reason"] for k, r, i in pair.d_events if k == "failed" and r == rid]
    return reasons[0] if reasons else ""


def check_refusal(pair: Pair, prid: str, rid: str, want: str) -> None:
    pair.until(lambda: bool(refused(pair, rid)), what="D fails the receive")
    assert want in refused(pair, rid) and "prompt mismatch" in refused(pair, rid)
    pair.until(lambda: "sent" in pair.p_kinds(prid), what="P frees the prompt's blocks")
    p, d = pair.p.worker.stats, pair.d.worker.stats
    assert p["prompt_mismatch"] == 1 and d["recv_prompt_mismatch"] == 1
    assert d["recv_failed"] == 0  # counted under its own cause
    assert p["writes"] == p["write_early"] == p["writes_done"] == 0  # no byte went to D
    assert not pair.d_kinds(rid).count("recv")
    pair.settle()


@pytest.mark.parametrize("d_print", [SAME_LENGTH, LONGER], ids=["other-ids", "other-length"])
@pytest.mark.parametrize("p_first", [True, False], ids=["p-first", "d-first"])
def test_a_registration_of_another_prompt_is_refused(
    pair_factory: Callable[..., Pair], p_first: bool, d_print: wire.PromptPrint
) -> None:
    pair = pair_factory()
    want = "differ from P's" if d_print.tokens == MINE.tokens else "D has 303 prompt tokens"
    if p_first:
        pair.p.prefill("p1", "t1", 3, prompt=MINE)
        pair.until(lambda: len(pair.p.worker.producer.staged) == 1, what="P staged")
    pair.d.register("d1", "t1", 3, "P", "127.0.0.1", pair.p.spec.port, prompt=d_print)
    if not p_first:
        pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1, what="D's PUSH_REG")
        pair.p.prefill("p1", "t1", 3, prompt=MINE)
    check_refusal(pair, "p1", "d1", want)


def test_an_armed_registration_of_another_prompt_is_not_launched(
    pair_factory: Callable[..., Pair],
) -> None:
    """P already knows D: D's registration arms the WRITE before P's blocks exist, and the
    blocks' arrival would post it before the producer's bookkeeping (``launch_armed``)."""
    pair = pair_factory()
    pair.p.prefill("p0", "t0", 2, prompt=MINE)
    pair.d.register("d0", "t0", 2, "P", "127.0.0.1", pair.p.spec.port, prompt=MINE)
    pair.until(lambda: recv_ok(pair, "d0"), what="the first push (P meets D)")
    pair.until(lambda: "sent" in pair.p_kinds("p0"), what="P frees it")
    p = pair.p.worker.stats
    writes = p["writes"]
    pair.d.register("d1", "t1", 3, "P", "127.0.0.1", pair.p.spec.port, prompt=SAME_LENGTH)
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1, what="D's PUSH_REG")
    group = next(iter(pair.p.worker.producer.pending_regs.values()))
    assert all(pend.armed is not None for pend in group.regs.values())  # the case in point
    pair.p.prefill("p1", "t1", 3, prompt=MINE)
    pair.until(lambda: bool(refused(pair, "d1")), what="D fails the receive")
    pair.until(lambda: "sent" in pair.p_kinds("p1"), what="P frees the prompt's blocks")
    assert p["prompt_mismatch"] == 1 and p["writes"] == writes and p["write_early"] == 0
    pair.settle()


@pytest.mark.parametrize(
    "p_print, d_print",
    [(MINE, MINE), (None, MINE), (MINE, None), (None, None)],
    ids=["same", "p-without", "d-without", "neither"],
)
def test_the_same_prompt_or_no_print_is_pushed(
    pair_factory: Callable[..., Pair],
    p_print: wire.PromptPrint | None,
    d_print: wire.PromptPrint | None,
) -> None:
    """Equal prints push as before; a side without a print (a seed decoder, a prompt of
    embeddings) is not checked."""
    pair = pair_factory()
    pair.p.prefill("p1", "t1", 3, prompt=p_print)
    pair.d.register("d1", "t1", 3, "P", "127.0.0.1", pair.p.spec.port, prompt=d_print)
    pair.until(lambda: recv_ok(pair, "d1"), what="the push")
    assert pair.p.worker.stats["prompt_mismatch"] == 0
    pair.settle()


def test_an_early_hand_over_of_another_prompt_is_refused(
    pair_factory: Callable[..., Pair],
) -> None:
    """An early hand-over (P pushes at the end of its forward) carries the print too."""
    pair = pair_factory()
    pair.d.register("d1", "t1", 3, "P", "127.0.0.1", pair.p.spec.port, prompt=LONGER)
    pair.until(lambda: len(pair.p.worker.producer.pending_regs) == 1, what="D's PUSH_REG")
    pair.p.prefill("p1", "t1", 3, early=True, prompt=MINE)
    pair.until(lambda: bool(refused(pair, "d1")), what="D fails the receive")
    pair.p.finish("p1")
    check_refusal(pair, "p1", "d1", "P computed 300")


# ---- the vLLM scheduler side ---------------------------------------------------------------


def test_scheduler_side_sends_each_sides_print() -> None:
    p, d = sides()
    params = {"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "h", "remote_port": 9}
    req = FakeRequest("cmpl-x-0-abcdef12", params, prompt_token_ids=PROMPT)
    d.get_num_new_matched_tokens(req, 0)
    d.update_state_after_alloc(req, ([7, 8, 9],), 300, block_size=128)
    (reg,) = d.sched.build_meta().registrations
    assert reg.prompt == MINE
    # P: a prefill handed over at its forward, and one staged when it finished.
    pp = {"do_remote_decode": True, "transfer_id": "t"}
    early = FakeRequest("early", dict(pp), prompt_token_ids=PROMPT)
    late = FakeRequest("late", dict(pp), prompt_token_ids=PROMPT[:200], max_tokens=4)
    for r in (early, late):
        p.update_state_after_alloc(r, ([1, 2, 3],), 0, block_size=128)
    meta = p.build_meta(SchedOut([NewReq("early", ([1, 2, 3],))], {"early": 300}))
    assert [s.prompt for s in meta.early] == [MINE]
    p.request_finished(late, [4, 5])
    p.request_finished(early, [1, 2, 3])  # (confirmed: its print went with the hand-over)
    meta = p.build_meta(SchedOut([], {}))
    assert [s.prompt for s in meta.finished] == [wire.fingerprint(PROMPT[:200])]
    assert meta.confirmed == ["early"]


def test_no_token_ids_no_print() -> None:
    assert prompt_print(FakeRequest("r", None, prompt_token_ids=None)) is None  # type: ignore[arg-type]
    assert prompt_print(FakeRequest("r", None, prompt_token_ids=[[1], [2, 3]])) is None  # type: ignore[list-item]
    assert prompt_print(FakeRequest("r", None, prompt_token_ids=[3, 4])) == wire.fingerprint([3, 4])
