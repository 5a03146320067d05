"""A partition under a posted WRITE (in-memory transport): P and D both hear nothing.
D fails the receive at its watchdog but keeps its blocks for late_write_hold_s (a WRITE
may still land); P, at its lease, disconnects the silent D, so the WRITE ends in error
and P frees its blocks instead of holding them for as long as the partition lasts; once
the link is back the next push handshakes afresh."""

from __future__ import annotations

from kvpush.core.transport import WriteState
from tests.unit.test_push_states import Pair, recv_ok

# The silence that counts as a partition is at least 2 s (PushWorker.silent).
LEASE = WATCHDOG = 2.5
HOLD = 2.0  # D's late_write_hold_s


def test_partition_under_a_write_frees_both_sides_and_nothing_lands_late() -> None:
    pair = Pair(lease_s=LEASE, watchdog_s=WATCHDOG, worker={"late_write_hold_s": HOLD})
    try:
        pair.p.prefill("p0", "t0", 1)
        pair.register("d0", "t0", 1)
        pair.until(lambda: recv_ok(pair, "d0"), what="a first push (connections up)")
        pair.fabric.hold_writes = True
        pair.p.prefill("p1", "t1", 4)
        pair.register("d1", "t1", 4)
        pair.until(lambda: len(pair.p.worker.producer.sender.writing) == 1, what="WRITE in flight")
        held = [w for w in pair.fabric.writes if w.state is WriteState.PENDING]
        pair.fabric.drop = lambda sender, target, msg: True  # the link is cut
        pair.until(lambda: "failed" in pair.d_kinds("d1"), 10, "D's watchdog")
        # P may still be writing, as far as D can tell: D keeps the blocks for its hold.
        assert pair.d.worker.stats["recv_held"] == 1 and pair.d.held_blocks() == 4
        pair.until(lambda: "sent" in pair.p_kinds("p1"), 10, "P freeing under its lease")
        assert pair.p.worker.stats["write_failed"] == 1
        assert [w.state for w in held] == [WriteState.ERROR]  # ended by the disconnect
        assert pair.d.worker.info.agent_name not in pair.p.worker.peers.by_agent
        # The link is back: the held WRITE cannot complete any more, the next push works.
        pair.fabric.drop = lambda sender, target, msg: False
        pair.fabric.hold_writes = False
        pair.fabric.complete_writes()
        assert [w.state for w in held] == [WriteState.ERROR]
        pair.settle()
        pair.p.prefill("p2", "t2", 3)
        pair.register("d2", "t2", 3)
        pair.until(lambda: recv_ok(pair, "d2"), what="a push after the partition")
        pair.settle()
    finally:
        pair.close()
