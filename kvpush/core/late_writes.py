"""How long D keeps the blocks of a receive whose prefiller went silent mid-push.

D's watchdog fails a receive when its P ranks fall silent. If the silence is a partition
rather than a dead P, bytes P's transport had queued on the TCP connection are delivered
once the link heals, straight into D's blocks: NIXL's disconnect does not stop them (seen
over a veth link, docs/reliability.md). So D fails such a request at once but keeps its
blocks out of vLLM's pool until the network stack must have given the old connection up.
Linux gives a connection up after ``tcp_retries2`` unanswered retransmissions whose
timeouts double from 200 ms to at most 120 s: about 924.6 s for the default 15, 3 s for 3.
"""

from __future__ import annotations

RETRIES2_PATH = "/proc/sys/net/ipv4/tcp_retries2"
DEFAULT_RETRIES2 = 15  # the kernel's default, when the setting cannot be read
RTO_MIN_S = 0.2
RTO_MAX_S = 120.0


def tcp_give_up_s(retries2: int) -> float:
    """Seconds from a connection's first unanswered retransmission until the kernel
    drops it (the kernel models it the same way, with the minimum RTO as its base)."""
    if retries2 < 0:
        raise ValueError(f"tcp_retries2 must be >= 0, got {retries2}")
    return round(sum(min(RTO_MIN_S * 2**i, RTO_MAX_S) for i in range(retries2 + 1)), 6)


def kernel_hold_s(path: str = RETRIES2_PATH) -> float:
    """The hold for this network namespace's ``tcp_retries2`` (P's hosts are assumed
    to be set up like ours; ``late_write_hold_s`` overrides it)."""
    try:
        with open(path) as f:
            retries2 = int(f.read().strip())
    except (OSError, ValueError):
        retries2 = DEFAULT_RETRIES2
    return tcp_give_up_s(max(retries2, 0))
