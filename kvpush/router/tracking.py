"""What each leg tells the router about the instance it ran on: its in-flight count,
its circuit breaker's verdict (a connection failure, a 5xx or a timeout counts against
it; a refusal, the client's mistake, does not; a leg cancelled because the other leg
failed says nothing), and its latency."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvpush.router import legs
from kvpush.router.call import Call
from kvpush.router.config import BACKGROUND
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import Instance

log = logging.getLogger("kvpush.router.app")

T = TypeVar("T")
# How long to wait for D's own refusal once P refused (both validate the same fields).
REFUSAL_GRACE_S = 1.0
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


class Interrupt:
    """While the current task waits for D's first chunk (no KV on D before it, so the
    request can still go again): cancels it once the prefill leg failed (a refusal only
    after `grace` seconds, for D's own refusal to come: both validate the same fields),
    or once P answered and then left the pool by its health probes (a P that answered
    and died never pushes: sent again at once instead of after D's watchdog). Leaving
    means going from healthy to not: a P the pool had not let in when the request chose
    it (none was available, or its probes have not passed yet since start-up) is not
    judged by its health until it has been healthy once. The wait
    runs in the handler's own task: a task per wait, and asyncio.wait on it, put two
    more loop turns between D's first chunk and the client."""

    def __init__(self, prefill: asyncio.Task[Any], p: Instance | None, grace: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.prefill, self.p, self.grace = prefill, p, grace
        self.reason: BaseException | None = None
        self.closed = False
        self.handle: asyncio.TimerHandle | None = None
        self.p_was_in = p is not None and p.healthy  # P in the pool at some check
        if p is not None:
            self.handle = self.loop.call_later(LOST_CHECK_S, self._check_lost)
        prefill.add_done_callback(self._prefill_done)

    def _prefill_done(self, task: asyncio.Task[Any]) -> None:
        if self.closed or task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        if self.handle is not None:
            self.handle.cancel()
        if isinstance(err, legs.LegError) and err.refused:
            self.handle = self.loop.call_later(self.grace, self._fire, err)
        else:
            self._fire(err)  # type: ignore[arg-type]

    def _check_lost(self) -> None:
        assert self.p is not None
        self.p_was_in = self.p_was_in or self.p.healthy
        if succeeded(self.prefill) and self.p_was_in and not self.p.healthy:
            why = f"prefiller {self.p.url} left the pool after answering, before D had the KV"
            self._fire(legs.LegError("prefill", "connection", why))
        else:
            self.handle = self.loop.call_later(LOST_CHECK_S, self._check_lost)

    def _fire(self, reason: BaseException) -> None:
        if self.reason is None and self.task is not None and not self.closed:
            self.reason = reason
            self.task.cancel()

    def caught(self) -> BaseException | None:
        """In an `except CancelledError`: why this interrupted the wait, or None when the
        cancel (also) came from elsewhere (the client left)."""
        if self.reason is not None and self.task is not None and self.task.uncancel() == 0:
            return self.reason
        return None

    def close(self) -> None:
        # A done callback already scheduled is not removed by remove_done_callback: the
        # flag keeps it from cancelling the task once the wait is over.
        self.closed = True
        if self.handle is not None:
            self.handle.cancel()
        self.prefill.remove_done_callback(self._prefill_done)


async def watched(
    prefill: asyncio.Task[Any], relay: Awaitable[T], grace: float, p: Instance | None = None
) -> T:
    """`relay` (a stream's copy, after D's first chunk), ended by the prefill leg's
    error once P fails (`Interrupt`; with `p`, also once P answered and left the pool,
    for a wait that comes before D has the KV). In the caller's task: a task for the
    relay and asyncio.wait on it cost loop turns."""
    interrupt = Interrupt(prefill, p, grace)
    try:
        return await relay
    except asyncio.CancelledError:
        reason = interrupt.caught()
        if reason is None:
            raise
        raise reason from None
    finally:
        interrupt.close()


def prefill_first(prefill: asyncio.Task[Any], d_err: legs.LegError | None) -> BaseException | None:
    """What to report once D's first chunk came (`d_err` None) or D failed: P's failure
    if P failed (a decode leg that fails because P failed is reported as the prefill
    failure that caused it), unless P refused and D answered too (then D's own answer:
    its refusal, or its stream, which holds the error event a plain server streams for a
    request it refuses after its 200); else `d_err`."""
    if not prefill.done() or prefill.cancelled() or prefill.exception() is None:
        return d_err
    p_err = prefill.exception()
    p_refused = isinstance(p_err, legs.LegError) and p_err.refused
    if p_refused and (d_err is None or d_err.refused):
        return d_err
    return p_err


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


def settle(call: Call, decode_ok: bool, *others: Any) -> None:
    """Cancel what is left of an attempt; keep a still-running prefill leg only on success."""
    for task in others:
        if isinstance(task, asyncio.Task):
            # Its error (say, a write to a client that left) is the handler's to report;
            # retrieved here so that it is not logged again as never retrieved.
            task.add_done_callback(retrieve)
            task.cancel()
    prefill = call.prefill
    if prefill.done() or not decode_ok:
        prefill.add_done_callback(retrieve)
        prefill.cancel()
        return
    background = call.app[BACKGROUND]
    metrics, tid = call.metrics, call.tid
    background.add(prefill)

    def _done(task: asyncio.Task[Any]) -> None:
        background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, legs.LegError) and exc.refused:  # the client's mistake, which
            log.debug("transfer %s: P refused after D answered: %s", tid, exc)  # D answered
        elif isinstance(exc, legs.LegError):
            metrics.error(exc.leg, exc.kind)
            log.warning("transfer %s: prefill failed after decode finished: %s", tid, exc)
        elif exc is not None:
            log.error("transfer %s: prefill leg crashed", tid, exc_info=exc)

    prefill.add_done_callback(_done)
