"""Two test hosts on one machine (needs root): P and D each in its own network namespace,
run with a private ``/dev/shm``, joined by one veth pair, the KV link:

    root ns (router)  10.N.1.1 ---front--- 10.N.1.2  P  10.N.3.1 ---link--- 10.N.3.2  D
                      10.N.2.1 ---front--- 10.N.2.2  D

The router in the root namespace reaches each server over its own front pair; P and D
reach each other only over the link (no forwarding in the root namespace), so the side
channel and NIXL (UCX restricted to TCP on the link) cross it, and cutting or slowing the
link touches only P-D traffic. Addresses exist only inside these namespaces and on the
root ends of the front pairs. Leftovers of a crashed run (same names) are removed first.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

LINK = "link0"  # the KV link's device, in both namespaces
FRONT = "front0"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


@dataclass
class Host:
    ns: str
    front: str  # the address the root namespace reaches it at
    link: str  # its address on the KV link
    root_dev: str  # the root end of its front pair

    def prefix(self) -> list[str]:
        """Run a command on this host: its network namespace, a mount namespace with its
        own tmpfs on /dev/shm (no shared-memory path to the other host)."""
        script = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation",
                "private", "sh", "-c", script, "sh"]  # fmt: skip

    def link_counter(self, name: str = "tx_bytes") -> int:
        """A counter of this host's end of the KV link (bytes that crossed it)."""
        path = f"/sys/class/net/{LINK}/statistics/{name}"
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns, "cat", path], check=True, capture_output=True
        )
        return int(out.stdout)


class HostPair:
    """P's and D's test hosts; a context manager that always removes what it made."""

    def __init__(self, prefix: str = "kvp", net: int = 77, tcp_retries2: int = 0) -> None:
        self.prefix = prefix
        # net.ipv4.tcp_retries2 inside both namespaces (0: the kernel's): bounds how long a
        # TCP connection survives a cut link before the kernel aborts it.
        self.tcp_retries2 = tcp_retries2
        a = f"10.{net}"
        self.p = Host(f"{prefix}-p", f"{a}.1.2", f"{a}.3.1", f"{prefix}-pf")
        self.d = Host(f"{prefix}-d", f"{a}.2.2", f"{a}.3.2", f"{prefix}-df")
        self._roots = {self.p.ns: f"{a}.1.1", self.d.ns: f"{a}.2.1"}

    @staticmethod
    def env() -> dict[str, str]:
        """UCX on the link's TCP only: no shared memory, no cross-memory attach."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": LINK}

    def __enter__(self) -> HostPair:
        if os.geteuid() != 0:
            raise RuntimeError("test hosts need root (network namespaces, mounts, tc)")
        missing = [t for t in ("ip", "tc", "unshare", "sysctl") if shutil.which(t) is None]
        if missing:
            raise RuntimeError(f"test hosts need {missing} (apt: iproute2, util-linux, procps)")
        self.remove()
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _make(self) -> None:
        p, d = self.p, self.d
        for h in (p, d):
            ip("netns", "add", h.ns)
            ip("-n", h.ns, "link", "set", "lo", "up")
            ip("link", "add", h.root_dev, "type", "veth", "peer", "name", FRONT, "netns", h.ns)
            ip("addr", "add", f"{self._roots[h.ns]}/24", "dev", h.root_dev)
            ip("link", "set", h.root_dev, "up")
            ip("-n", h.ns, "addr", "add", f"{h.front}/24", "dev", FRONT)
            ip("-n", h.ns, "link", "set", FRONT, "up")
            if self.tcp_retries2:
                sysctl = f"net.ipv4.tcp_retries2={self.tcp_retries2}"
                subprocess.run(["ip", "netns", "exec", h.ns, "sysctl", "-qw", sysctl], check=True)
        ip("-n", p.ns, "link", "add", LINK, "type", "veth", "peer", "name", LINK, "netns", d.ns)
        for h in (p, d):
            ip("-n", h.ns, "addr", "add", f"{h.link}/24", "dev", LINK)
        self.link_up()

    def remove(self) -> None:
        """Kill what still runs in our namespaces (by pid), delete them and our root ends."""
        for h in (self.p, self.d):
            got = ip("netns", "pids", h.ns, check=False)
            for pid in got.stdout.split() if got.returncode == 0 else []:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            ip("netns", "del", h.ns, check=False)  # takes the veth ends inside with it
            ip("link", "del", h.root_dev, check=False)

    # ---- the link --------------------------------------------------------------------

    def link_down(self) -> None:
        for h in (self.p, self.d):
            ip("-n", h.ns, "link", "set", LINK, "down")

    def link_up(self) -> None:
        for h in (self.p, self.d):
            ip("-n", h.ns, "link", "set", LINK, "up")
        # Wait for the carrier, so the caller's next packet is not dropped.
        deadline = time.monotonic() + 10
        while "LOWER_UP" not in ip("-n", self.p.ns, "link", "show", LINK).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{LINK} has no carrier 10 s after link up")
            time.sleep(0.05)

    def limit(self, rate: str, burst: str = "64kb", latency: str = "200ms") -> None:
        """A token bucket (``tc tbf``) on both ends of the link: ``rate`` as tc reads it
        (``100mbit``). This kernel has no netem, so no added delay or loss."""
        for h in (self.p, self.d):
            subprocess.run(
                ["tc", "-n", h.ns, "qdisc", "replace", "dev", LINK, "root", "tbf",
                 "rate", rate, "burst", burst, "latency", latency],
                check=True, capture_output=True,
            )  # fmt: skip

    def unlimit(self) -> None:
        for h in (self.p, self.d):
            subprocess.run(
                ["tc", "-n", h.ns, "qdisc", "del", "dev", LINK, "root"], capture_output=True
            )
