"""The HTTP client's reading of a stream: text, first and second token times, errors."""

from __future__ import annotations

import json
from typing import Any

from kvpush.deploy.client import _read_stream
from kvpush_bench.pairs import Sample
from kvpush_bench.vllm_gpu import aggregate


def lines(*events: Any) -> list[bytes]:
    out = []
    for e in events:
        out.append(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n")
        out.append(b"\n")
    return out


def piece(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def test_a_stream_gives_its_text_and_first_and_second_token_times() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 7}}
    reply = _read_stream(lines(piece("a"), piece("b"), piece("c"), usage, b"[DONE]"), False, 0.0)
    assert reply.ok and reply.text == "abc" and reply.prompt_tokens == 7
    assert 0 < reply.ttft_s <= reply.second_s <= reply.total_s


def test_one_piece_has_no_second_token_and_an_error_event_fails() -> None:
    assert _read_stream(lines(piece("a"), b"[DONE]"), False, 0.0).second_s == 0.0
    failed = _read_stream(lines(piece("a"), {"error": {"code": 502}}, b"[DONE]"), False, 0.0)
    assert not failed.ok and "502" in failed.error


def test_the_benchmark_reports_the_second_token_of_streams_that_had_one() -> None:
    samples = {
        ("plain", 8, 1): [Sample(True, 0.010, 0.05, second_s=0.012), Sample(True, 0.02, 0.05)],
        ("kvpush", 8, 1): [Sample(True, 0.011, 0.05, second_s=0.021)],
    }
    cell = aggregate(samples, ["plain", "kvpush"], (8,), (1,))["cells"]["8tok_c1"]
    assert cell["plain"]["second_token_ms"]["n"] == 1
    assert cell["plain"]["second_token_ms"]["median"] == 12.0
    assert cell["kvpush"]["second_token_ms"]["median"] == 21.0
