"""Request bodies into and out of the router, and the upstream events it reads (`loads`):
msgspec's JSON for the usual body, Python's ``json`` for what msgspec refuses.

A plain vLLM server reads a body with Python's ``json``, so the router must accept and
refuse what it does, and forward what it read unchanged. msgspec reads a subset of what
``json`` reads, to the same values (checked in tests/unit/test_router_jsonbody.py); what it
refuses (NaN and Infinity literals, numbers beyond a double, lone surrogates, UTF-16 or
a byte-order mark) goes to ``json``, whose answer stands. Such a body's legs are written by
``json`` too: msgspec would write NaN and Infinity as null. The prompt is most of a
long request's body, and both legs carry it: ``json`` took about 1.5 ms to read and write
the legs of an 8,000-token prompt on this project's CI machine, msgspec 0.4 ms.
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
# Whether the legs of the request being handled must be written by json: set by parse()
# and read by dump() (tasks the handler starts copy it). aiohttp may handle a keep-alive
# connection's requests one after another in one task, so parse() sets it every time.
_BY_JSON: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpush_body_by_json")


def parse(raw: bytes) -> Any:
    """What ``json.loads(raw)`` returns; raises what it raises."""
    body, by_json = _read(raw)
    _BY_JSON.set(by_json)
    return body


def loads(raw: bytes) -> Any:
    """What ``json.loads(raw)`` returns, for JSON that is not a request body (an
    upstream's event): this request's legs are written as before."""
    return _read(raw)[0]


def _read(raw: bytes) -> tuple[Any, bool]:
    try:
        return _decoder.decode(raw), False
    except (msgspec.DecodeError, RecursionError):  # (nesting: json's own limit decides)
        return json.loads(raw), True


def dump(obj: Any) -> bytes:
    """``obj`` as JSON bytes, written by ``json`` when this request's body was read by it."""
    if not _BY_JSON.get(False):
        try:
            return _encoder.encode(obj)
        except (TypeError, UnicodeEncodeError):
            pass  # (not from a body msgspec read; json decides)
    return json.dumps(obj).encode()
