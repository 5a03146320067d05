"""What each leg tells the router about the instance it ran on: its in-flight count,
its circuit breaker's verdict (a connection failure, a 5xx or a timeout counts against
it; a refusal, the client's mistake, does not; a leg cancelled because the other leg
failed says nothing), and its latency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvpush.router import legs
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Instance

T = TypeVar("T")
LOST_CHECK_S = 0.25  # how often a request waiting on D looks whether its P left the pool


class Verdict:
    """How a leg went for its instance: set by the code that sees its outcome."""

    def __init__(self) -> None:
        self.ok = False
        self.failed: str | None = None  # the LegError kind that counts against it

    def judge(self, err: legs.LegError) -> None:
        if err.refused:
            self.ok = True  # it answered, and rightly
        else:
            self.failed = err.kind


@contextmanager
def using(metrics: RouterMetrics, inst: Instance) -> Iterator[Verdict]:
    """Count a leg in flight on `inst` while the block runs; apply its verdict after."""
    inst.in_flight += 1
    inst.breaker.started()
    verdict = Verdict()
    try:
        yield verdict
    finally:
        inst.in_flight -= 1
        if verdict.failed is not None:
            inst.breaker.failure()
            metrics.instance_failed(inst.role, inst.url, verdict.failed)
        elif verdict.ok:
            inst.breaker.success()
        else:
            inst.breaker.released()


async def leg(metrics: RouterMetrics, inst: Instance, call: Awaitable[T]) -> T:
    """Run one whole leg (a unary call) on `inst`, tracked and timed."""
    with using(metrics, inst) as verdict:
        start = time.monotonic()
        try:
            result = await call
        except legs.LegError as err:
            verdict.judge(err)
            raise
        verdict.ok = True
        metrics.leg_finished(inst.role, time.monotonic() - start, inst.url)
        return result


async def timed(metrics: RouterMetrics, inst: Instance, call: Awaitable[T]) -> T:
    """Time a part of a leg whose tracking the caller does (`using`)."""
    start = time.monotonic()
    result = await call
    metrics.leg_finished(inst.role, time.monotonic() - start, inst.url)
    return result


async def unless_lost(p: Instance, decode: asyncio.Task[T]) -> T:
    """D's result; or, once P left the pool by its health probes while D still waits for
    the KV P answered for, a prefill `LegError`: the request can be sent again at once
    instead of after D's watchdog (a P that answered and died never pushes)."""
    while True:
        done, _ = await asyncio.wait({decode}, timeout=LOST_CHECK_S)
        if done:
            return decode.result()
        if not p.healthy:
            why = f"prefiller {p.url} left the pool after answering, before D had the KV"
            raise legs.LegError("prefill", "connection", why)


def succeeded(task: asyncio.Task[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def refusal(task: asyncio.Task[Any]) -> legs.LegError | None:
    """The leg's refusal (a 4xx: the client's mistake), once it ended with one."""
    if not task.done() or task.cancelled():
        return None
    err = task.exception()
    return err if isinstance(err, legs.LegError) and err.refused else None


def retrieve(task: asyncio.Task[Any]) -> None:
    """A done callback: take the task's outcome so that asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()
