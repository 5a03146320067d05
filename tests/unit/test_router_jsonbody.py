"""The router reads and writes bodies as Python's json does (kvpush/router/jsonbody.py)."""

from __future__ import annotations

import contextvars
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.router import jsonbody

RAW = [
    b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": true}',
    b'{"a": 1, "a": 2}',
    b'{"temperature": NaN}',
    b'{"top_p": Infinity, "x": -Infinity}',
    b'{"seed": 123456789012345678901234567890}',
    b'{"seed": -9223372036854775809}',
    b'{"f": 1e400}',
    b'{"f": 1.5e-400, "g": -0.0, "h": 1E2}',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "\\ud83d\\ude00 \\u00e9 \xc3\xa9"}',
    b"\xef\xbb\xbf{}",
    '{"prompt": "\u00e9"}'.encode("utf-16"),
    b'\t{"a": [1, 2.5, true, null]}\r\n',
    b'"a\nb"',
    b'{"a": 1,}',
    b'{"a": 1}x',
    b'"\xff"',
    b"01",
    b"",
    b"[" * 150 + b"]" * 150,
    b"[" * 5000 + b"]" * 5000,
]


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 == 1.0 == True would pass ==)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _outcome(fn: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "ok", fn(raw)
    except Exception as exc:  # the type is what a client's answer depends on
        return "raised", type(exc)


def _assert_as_json(got: tuple[str, Any], want: tuple[str, Any]) -> None:
    """The same value as json's, or the same exception type."""
    assert got[0] == want[0], (got, want)
    assert _same(got[1], want[1]) if got[0] == "ok" else got[1] is want[1]


@pytest.mark.parametrize("raw", RAW)
def test_parse_reads_what_json_reads(raw: bytes) -> None:
    got = contextvars.copy_context().run(_outcome, jsonbody.parse, raw)
    want = _outcome(json.loads, raw)
    _assert_as_json(got, want)


@pytest.mark.parametrize("raw", [r for r in RAW if _outcome(json.loads, r)[0] == "ok"])
def test_legs_carry_what_json_would_write(raw: bytes) -> None:
    def both() -> tuple[Any, Any]:
        body = jsonbody.parse(raw)
        leg = {"body": body, "kv_transfer_params": {"transfer_id": "t"}}
        return json.loads(jsonbody.dump(leg)), leg

    sent, leg = contextvars.copy_context().run(both)
    assert _same(sent, json.loads(json.dumps(leg)))


def test_nan_is_written_as_nan_not_null() -> None:
    def run() -> bytes:
        return jsonbody.dump(jsonbody.parse(b'{"temperature": NaN, "n": 1}'))

    out = contextvars.copy_context().run(run)
    assert b"NaN" in out and b"null" not in out


def test_each_request_chooses_again() -> None:
    """A keep-alive connection's requests share one context: a NaN body before must not
    make a usual body's legs slow, nor a usual body before make a NaN body's legs lossy."""

    def run() -> list[bytes]:
        out = []
        for raw in (b'{"a": NaN}', b'{"a": 1}', b'{"a": Infinity}'):
            out.append(jsonbody.dump(jsonbody.parse(raw)))
        return out

    nan, usual, inf = contextvars.copy_context().run(run)
    assert nan == b'{"a": NaN}' and inf == b'{"a": Infinity}'
    assert usual == b'{"a":1}'  # msgspec's compact form: the fast path was taken


@pytest.mark.parametrize("raw", RAW)
def test_loads_reads_what_json_reads_and_leaves_the_legs_be(raw: bytes) -> None:
    """An upstream's event read between a NaN body and its legs: the legs still keep NaN."""

    def run() -> tuple[tuple[str, Any], bytes]:
        body = jsonbody.parse(b'{"a": NaN}')
        got = _outcome(jsonbody.loads, raw)
        return got, jsonbody.dump(body)

    got, legs = contextvars.copy_context().run(run)
    want = _outcome(json.loads, raw)
    _assert_as_json(got, want)
    assert legs == b'{"a": NaN}'


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_any_json_value_reads_and_writes_as_json_does(value: Any) -> None:
    raw = json.dumps(value).encode()

    def run() -> tuple[Any, bytes]:
        body = jsonbody.parse(raw)
        return body, jsonbody.dump(body)

    body, out = contextvars.copy_context().run(run)
    assert _same(body, json.loads(raw))
    assert _same(json.loads(out), json.loads(raw))
