"""Fixtures of the unit tests that run P and D over the in-memory transport."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.unit.test_push_states import Pair


@pytest.fixture
def pair_factory() -> Iterator[Callable[..., Pair]]:
    """Makes ``Pair``s (keyword arguments as ``Pair``'s) and closes them after the test."""
    made: list[Pair] = []

    def make(**kw: Any) -> Pair:
        made.append(Pair(**kw))
        return made[-1]

    yield make
    for p in made:
        p.close()
