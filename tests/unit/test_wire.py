from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.core import wire
from kvpush.core.errors import WireError


def make_reg(**kw: object) -> wire.PushReg:
    fields: dict[str, object] = dict(
        request_id="cmpl-abc-0-1234abcd",
        decode_engine_id="D",
        decode_host="127.0.0.1",
        decode_port=5601,
        decode_tp_size=1,
        local_block_ids=[[3, 4, 9]],
        remote_engine_id="P",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_tp_size=1,
    )
    fields.update(kw)
    return wire.PushReg(**fields)  # type: ignore[arg-type]


SEED_FIELDS = {
    "request_id",
    "decode_engine_id",
    "decode_host",
    "decode_port",
    "decode_tp_size",
    "local_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_tp_size",
}


def test_push_reg_is_seed_compatible() -> None:
    data = wire.encode(make_reg())
    assert data.startswith(b"PUSH_REG:")
    as_dict = msgspec.msgpack.decode(data[len(b"PUSH_REG:") :])
    assert SEED_FIELDS <= set(as_dict)
    # A seed sender omits transfer_id: still accepted.
    seed_only = {k: v for k, v in as_dict.items() if k in SEED_FIELDS}
    got = wire.decode(b"PUSH_REG:" + msgspec.msgpack.encode(seed_only))
    assert isinstance(got, wire.PushReg) and got.transfer_id is None


@pytest.mark.parametrize(
    "msg",
    [
        make_reg(transfer_id="t-1"),
        wire.PushFail(request_id="r1", reason="lease expired", transfer_id="t"),
        wire.PushCancel(request_id="r1"),
        wire.Heartbeat(entries=[wire.HbEntry("r1", "t1"), wire.HbEntry("r2")]),
        wire.Completion("cmpl-1:0-abcdef12", 2),
    ],
)
def test_round_trip(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg)) == msg


def test_completion_format_is_request_colon_tp() -> None:
    assert wire.encode(wire.Completion("req-7", 4)) == b"req-7:4"
    assert wire.decode(b"a:b:c:2") == wire.Completion("a:b:c", 2)


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"", "unknown"),
        (b"HELLO", "unknown"),
        (b"PUSH_XYZ:abc", "unknown"),
        (b"req:0", "unknown"),  # tp_size must be >= 1
        (b"req:99999", "unknown"),
        (b"r e q:1", "unknown"),
        (b"PUSH_REG:\xff\xfe", "bad PUSH_REG"),
        (b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": 5}), "bad PUSH_REG"),
        (b"PUSH_FAIL:" + msgspec.msgpack.encode([1, 2]), "bad PUSH_FAIL"),
        (b"PUSH_HB:" + msgspec.msgpack.encode({"entries": "x"}), "bad PUSH_HB"),
        (b"x" * (wire.MAX_MESSAGE_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_rejected(raw: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        wire.decode(raw)


@pytest.mark.parametrize(
    "blocks, why",
    [
        ([[1, 2, 2]], "duplicate"),
        ([[-1]], "bad PUSH_REG"),
        ([[2**40]], "bad PUSH_REG"),
        ([[]], "no block ids"),
        ([], "bad PUSH_REG"),
        ([["1"]], "bad PUSH_REG"),
    ],
)
def test_bad_block_ids_rejected(blocks: list[list[object]], why: str) -> None:
    body = msgspec.msgpack.decode(wire.encode(make_reg())[len(b"PUSH_REG:") :])
    body["local_block_ids"] = blocks
    with pytest.raises(WireError, match=why):
        wire.decode(b"PUSH_REG:" + msgspec.msgpack.encode(body))


def test_bad_rank_and_port_rejected() -> None:
    with pytest.raises(WireError, match="decode_tp_rank"):
        wire.decode(wire.encode(make_reg(decode_tp_rank=3, decode_tp_size=2)))
    body = msgspec.msgpack.decode(wire.encode(make_reg())[len(b"PUSH_REG:") :])
    body["decode_port"] = 70000
    with pytest.raises(WireError):
        wire.decode(b"PUSH_REG:" + msgspec.msgpack.encode(body))


def test_completion_refuses_unsendable_ids() -> None:
    with pytest.raises(WireError):
        wire.encode_completion("has space", 1)
    with pytest.raises(WireError):
        wire.encode_completion("PUSH_REG:x", 1)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decode_never_raises_anything_but_wire_error(raw: bytes) -> None:
    try:
        wire.decode(raw)
    except WireError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([b"PUSH_REG:", b"PUSH_FAIL:", b"PUSH_CANCEL:", b"PUSH_HB:"]),
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
        max_leaves=12,
    ),
)
def test_decode_prefixed_garbage(prefix: bytes, obj: object) -> None:
    try:
        wire.decode(prefix + msgspec.msgpack.encode(obj))
    except WireError:
        pass
