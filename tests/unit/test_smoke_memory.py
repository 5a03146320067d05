from __future__ import annotations

from kvpush.core.memory_transport import Fabric, MemoryTransport
from kvpush.core.worker import make_agent_name
from kvpush.sim.engine import SimEngine, SimSpec
from tests.conftest import free_port, wait_until


def test_push_one_request_both_orders() -> None:
    fabric = Fabric()
    p = SimEngine(SimSpec("P", free_port()), MemoryTransport(fabric, make_agent_name("P", 0)))
    d = SimEngine(SimSpec("D", free_port()), MemoryTransport(fabric, make_agent_name("D", 0)))
    try:
        p.prefill("r1-aaaaaaaa", "t1", 5)
        d.register("r1-bbbbbbbb", "t1", 5, "P", "127.0.0.1", p.spec.port)
        d.register("r2-bbbbbbbb", "t2", 3, "P", "127.0.0.1", p.spec.port)

        def step() -> None:
            p.step()
            d.step()

        got: list = []
        wait_until(
            lambda: len([e for e in got if e[0] == "recv"]) == 1,
            step=lambda: (step(), got.extend(d.take_events())),
            what="first recv",
        )
        p.prefill("r2-aaaaaaaa", "t2", 3)
        wait_until(
            lambda: len([e for e in got if e[0] == "recv"]) == 2,
            step=lambda: (step(), got.extend(d.take_events())),
            what="second recv",
        )
        assert all(e[2]["bad_regions"] == 0 for e in got if e[0] == "recv")
        wait_until(lambda: p.held_blocks() == 0 and d.held_blocks() == 0, step=step)
    finally:
        p.close()
        d.close()
