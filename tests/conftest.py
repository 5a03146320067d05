"""Shared test helpers."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest


def free_port() -> int:
    from kvpush.deploy.servers import free_port as pick

    return pick()


def wait_until(
    cond: Callable[[], bool],
    timeout: float = 10.0,
    step: Callable[[], None] | None = None,
    what: str = "condition",
) -> None:
    """Poll ``cond`` (calling ``step`` between polls) until true; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.001)
