from __future__ import annotations

from kvpush.core.ids import Key, MatchTable, base_request_id


def test_base_id_strips_only_the_engine_suffix() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-1-1a2b3c4d") == "cmpl-abc-1"  # completion index kept
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("x-1A2B3C4D") == "x-1A2B3C4D"  # upper case is not vLLM's suffix
    assert base_request_id("x-123") == "x-123"


def test_transfer_id_wins() -> None:
    t: MatchTable[str] = MatchTable()
    t.add(Key("p-req-aaaaaaaa", "tid-1"), "one")
    t.add(Key("other", "tid-2"), "two")
    assert t.find(Key("unrelated", "tid-2")) == "two"
    assert t.by_tid("tid-2") == "two"  # the one-lookup form P tries before a copy
    assert t.by_tid(None) is None and t.by_tid("tid-3") is None
    assert t.pop(Key("d-req", "tid-1")) == "one"
    assert len(t) == 1 and t.by_tid("tid-1") is None


def test_different_transfer_ids_never_match() -> None:
    t: MatchTable[str] = MatchTable()
    t.add(Key("cmpl-x-0-aaaaaaaa", "tid-1"), "one")
    assert t.find(Key("cmpl-x-0-aaaaaaaa", "tid-2")) is None
    assert t.find(Key("cmpl-x-0-bbbbbbbb", "tid-2")) is None


def test_exact_then_base_fallback() -> None:
    t: MatchTable[str] = MatchTable()
    t.add(Key("cmpl-x-0-aaaaaaaa"), "base")
    t.add(Key("cmpl-x-0-cccccccc"), "exact")
    assert t.find(Key("cmpl-x-0-cccccccc")) == "exact"
    assert t.find(Key("cmpl-x-0-bbbbbbbb")) == "base"  # oldest base-id candidate
    assert t.find(Key("cmpl-x-1-bbbbbbbb")) is None  # other completion index
    # one side carries a transfer id, the other not: the request id decides
    assert t.find(Key("cmpl-x-0-cccccccc", "tid-9")) == "exact"


def test_pop_value_and_reuse() -> None:
    t: MatchTable[object] = MatchTable()
    a, b = object(), object()
    t.add(Key("r-aaaaaaaa", "t1"), a)
    t.add(Key("r-bbbbbbbb", "t2"), b)
    assert t.pop_value(a)
    assert not t.pop_value(a)
    assert t.find(Key("r-cccccccc")) is b
    t.add(Key("r-aaaaaaaa", "t1"), a)  # transfer id free again
    assert t.find(Key("q", "t1")) is a
