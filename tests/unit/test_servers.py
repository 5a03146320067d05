"""kvpush.deploy.servers helpers that need no server."""

from __future__ import annotations

import os
import signal

import pytest

from kvpush.deploy.servers import sigterm_as_interrupt


def test_sigterm_inside_the_block_is_a_keyboard_interrupt_and_the_old_handler_returns() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not interrupt the block")
        os.kill(os.getpid(), signal.SIGTERM)  # outside: the handler from before again
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
