"""Shared test helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

# Illegal state moves raise (core/types.transition), here and in every process a test starts.
os.environ["KVPUSH_STRICT_STATES"] = "1"


@pytest.fixture(autouse=True)
def _no_illegal_transitions() -> Any:
    """Fail a test in whose process a transfer made an illegal move, even one a writer's
    guard caught and counted (the raise alone would only show as ``writer_errors``)."""
    from kvpush.core import types

    types.STRICT = True  # in case kvpush was imported before this file set the variable
    types.ILLEGAL_SEEN.clear()
    yield
    seen, types.ILLEGAL_SEEN[:] = list(types.ILLEGAL_SEEN), []
    assert not seen, f"illegal state moves: {seen}"


def illegal_moves(proc: Any) -> int:
    """Illegal state moves a child engine (``sim.process.EngineProcess``) counted: its
    writer's guard catches the strict raise, so only its count shows it."""
    try:
        return int(proc.stats(timeout=5).get("illegal_transition", 0))
    except (TimeoutError, RuntimeError):  # dead or stuck: its test says why
        return 0


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


def plain_reference(plain: Any, model: str, cases: Sequence[Any]) -> dict[str, Any]:
    """One plain vLLM server's answers to ``cases`` (objects with ``name`` and
    ``send(url, model)``), the reference a P/D pair must match; the server is stopped
    afterwards whatever happens, and every answer must be a success."""
    from kvpush.deploy.servers import wait_healthy

    try:
        wait_healthy([plain])
        reference = {c.name: c.send(plain.url, model) for c in cases}
    finally:
        plain.stop()
    assert all(r.ok for r in reference.values()), reference
    return reference
