"""Shared test helpers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

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


def wait_no_kv_in_use(servers: Sequence[Any], timeout: float = 30.0) -> None:
    """Poll every vLLM server's ``vllm:kv_cache_usage_perc`` (objects with ``url`` and a
    ``name``) until all read 0; fail with their readings after ``timeout`` s."""
    from kvpush.deploy.servers import metric

    deadline = time.monotonic() + timeout
    while True:
        usage = {s.name: metric(s.url, "vllm:kv_cache_usage_perc") for s in servers}
        if not any(usage.values()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"KV cache still in use after {timeout:g}s: {usage}")
        time.sleep(0.2)
