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


def test_no_port_is_handed_out_twice() -> None:
    """A port stays free until its server binds it, so calls made before then must not
    repeat one (a decoder's side channel once took its own HTTP server's port). 400 random
    picks from 12,000 ports would repeat one almost surely."""
    from kvpush.deploy.servers import free_port, free_ports

    ports = [free_port() for _ in range(400)]
    base = free_ports(4)
    assert len(set(ports)) == len(ports)
    assert not set(range(base, base + 4)) & set(ports)
    assert all(20000 <= p < 32000 for p in [*ports, base + 3])
