"""Two test hosts on one machine (needs root): P and D each in its own network namespace,
run with a private ``/dev/shm``, joined by one veth pair, the KV link:

    root ns (router)  10.N.1.1 ---front--- 10.N.1.2  P  10.N.3.1 ---link--- 10.N.3.2  D
                      10.N.2.1 ---front--- 10.N.2.2  D

The router in the root namespace reaches each server over its own front pair; P and D
reach each other only over the link (no forwarding in the root namespace), so the side
channel and NIXL (UCX restricted to TCP on the link) cross it, and cutting or slowing the
link touches only P-D traffic. Addresses exist only inside these namespaces and on the
root ends of the front pairs. Leftovers of a crashed run (same names) are removed first.

Two ways to do it, chosen once by ``choose_net()``: the ``ip``/``tc`` binaries of iproute2 (CI,
``IpNet`` here), or, on machines without them (the GPU machine), netlink through the
pure-Python ``pyroute2`` (``tests/e2e/hosts_pyroute2.py``). Both make the same hosts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Protocol

LINK = "link0"  # the KV link's device, in both namespaces
FRONT = "front0"
# Run in a host: a mount namespace of its own, with its own tmpfs on /dev/shm (no
# shared-memory path to the other host); "$@" is the command.
SHM_SCRIPT = 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"'


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Net(Protocol):
    """What HostPair needs of the machine's networking; ``ns`` None: the root namespace."""

    def tools(self) -> list[str]: ...  # missing tools, as an error message's list
    def enter(self, ns: str, mount_script: str) -> list[str]: ...
    def add_ns(self, ns: str) -> None: ...
    def del_ns(self, ns: str) -> None: ...  # and kill what runs in it; no error if absent
    def veth(self, ns: str | None, name: str, peer_ns: str, peer: str) -> None: ...
    def del_link(self, name: str) -> None: ...  # a root-namespace device; no error if absent
    def addr(self, ns: str | None, dev: str, cidr: str) -> None: ...
    def set_up(self, ns: str | None, dev: str, up: bool) -> None: ...
    def running(self, ns: str, dev: str) -> bool: ...
    def sysctl(self, ns: str, key: str, value: int) -> None: ...
    def tbf(self, ns: str, dev: str, rate: str, burst: str, latency: str) -> None: ...
    def no_qdisc(self, ns: str, dev: str) -> None: ...
    def counter(self, ns: str, dev: str, name: str) -> int: ...


class IpNet:
    """The ``ip``, ``tc`` and ``sysctl`` binaries (iproute2, procps)."""

    def tools(self) -> list[str]:
        return [t for t in ("ip", "tc", "unshare", "sysctl") if shutil.which(t) is None]

    def enter(self, ns: str, mount_script: str) -> list[str]:
        # `ip netns exec` also mounts a sysfs of the namespace on /sys.
        return ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation",
                "private", "sh", "-c", mount_script, "sh"]  # fmt: skip

    def add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)

    def del_ns(self, ns: str) -> None:
        got = ip("netns", "pids", ns, check=False)
        for pid in got.stdout.split() if got.returncode == 0 else []:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("netns", "del", ns, check=False)  # takes the veth ends inside with it

    def veth(self, ns: str | None, name: str, peer_ns: str, peer: str) -> None:
        where = ["-n", ns] if ns else []
        ip(*where, "link", "add", name, "type", "veth", "peer", "name", peer, "netns", peer_ns)

    def del_link(self, name: str) -> None:
        ip("link", "del", name, check=False)

    def addr(self, ns: str | None, dev: str, cidr: str) -> None:
        ip(*(["-n", ns] if ns else []), "addr", "add", cidr, "dev", dev)

    def set_up(self, ns: str | None, dev: str, up: bool) -> None:
        ip(*(["-n", ns] if ns else []), "link", "set", dev, "up" if up else "down")

    def running(self, ns: str, dev: str) -> bool:
        return " state UP " in ip("-n", ns, "link", "show", dev).stdout

    def sysctl(self, ns: str, key: str, value: int) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"], check=True)

    def tbf(self, ns: str, dev: str, rate: str, burst: str, latency: str) -> None:
        subprocess.run(
            ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", rate, "burst", burst, "latency", latency],
            check=True, capture_output=True,
        )  # fmt: skip

    def no_qdisc(self, ns: str, dev: str) -> None:
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)

    def counter(self, ns: str, dev: str, name: str) -> int:
        path = f"/sys/class/net/{dev}/statistics/{name}"
        out = subprocess.run(["ip", "netns", "exec", ns, "cat", path], check=True,
                             capture_output=True)  # fmt: skip
        return int(out.stdout)


def choose_net() -> Net:
    """iproute2's binaries where they are (CI); else pyroute2 (the GPU machine has no
    ``ip``/``tc``, but its kernel does namespaces, veth and tbf)."""
    if shutil.which("ip") and shutil.which("tc"):
        return IpNet()
    try:
        from tests.e2e.hosts_pyroute2 import Pr2Net
    except ImportError as e:
        raise RuntimeError(f"test hosts need iproute2 (ip, tc) or pyroute2 ({e})") from e
    return Pr2Net()


@dataclass
class Host:
    ns: str
    front: str  # the address the root namespace reaches it at
    link: str  # its address on the KV link
    root_dev: str  # the root end of its front pair
    net: Net = field(default_factory=choose_net, repr=False)

    def prefix(self) -> list[str]:
        """Run a command on this host: its network namespace, a mount namespace with its
        own tmpfs on /dev/shm (no shared-memory path to the other host)."""
        return self.net.enter(self.ns, SHM_SCRIPT)

    def link_counter(self, name: str = "tx_bytes") -> int:
        """A counter of this host's end of the KV link (bytes that crossed it)."""
        return self.net.counter(self.ns, LINK, name)


class HostPair:
    """P's and D's test hosts; a context manager that always removes what it made."""

    def __init__(self, prefix: str = "kvp", net: int = 77, tcp_retries2: int = 0) -> None:
        self.prefix = prefix
        # net.ipv4.tcp_retries2 inside both namespaces (0: the kernel's): bounds how long a
        # TCP connection survives a cut link before the kernel aborts it.
        self.tcp_retries2 = tcp_retries2
        self.net = choose_net()
        a = f"10.{net}"
        self.p = Host(f"{prefix}-p", f"{a}.1.2", f"{a}.3.1", f"{prefix}-pf", self.net)
        self.d = Host(f"{prefix}-d", f"{a}.2.2", f"{a}.3.2", f"{prefix}-df", self.net)
        self._roots = {self.p.ns: f"{a}.1.1", self.d.ns: f"{a}.2.1"}

    @staticmethod
    def env() -> dict[str, str]:
        """UCX on the link's TCP only: no shared memory, no cross-memory attach. Where
        the machine has an NVIDIA GPU, NIXL refuses a UCX_TLS without ``cuda_copy`` (it
        moves no byte between two hosts' CPU memory)."""
        tls = "tcp,cuda_copy" if os.path.exists("/proc/driver/nvidia") else "tcp"
        return {"UCX_TLS": tls, "UCX_NET_DEVICES": LINK}

    def __enter__(self) -> HostPair:
        if os.geteuid() != 0:
            raise RuntimeError("test hosts need root (network namespaces, mounts, tc)")
        missing = self.net.tools()
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
        p, d, n = self.p, self.d, self.net
        for h in (p, d):
            n.add_ns(h.ns)
            n.set_up(h.ns, "lo", True)
            n.veth(None, h.root_dev, h.ns, FRONT)
            n.addr(None, h.root_dev, f"{self._roots[h.ns]}/24")
            n.set_up(None, h.root_dev, True)
            n.addr(h.ns, FRONT, f"{h.front}/24")
            n.set_up(h.ns, FRONT, True)
            if self.tcp_retries2:
                n.sysctl(h.ns, "net.ipv4.tcp_retries2", self.tcp_retries2)
        n.veth(p.ns, LINK, d.ns, LINK)
        for h in (p, d):
            n.addr(h.ns, LINK, f"{h.link}/24")
        self.link_up()

    def remove(self) -> None:
        """Kill what still runs in our namespaces (by pid), delete them and our root ends."""
        for h in (self.p, self.d):
            self.net.del_ns(h.ns)
            self.net.del_link(h.root_dev)

    # ---- the link --------------------------------------------------------------------

    def link_down(self) -> None:
        for h in (self.p, self.d):
            self.net.set_up(h.ns, LINK, False)

    def link_up(self) -> None:
        for h in (self.p, self.d):
            self.net.set_up(h.ns, LINK, True)
        # Wait until the kernel reports both ends operationally up (it does so a moment
        # after the carrier): UCX picks only running devices, and the caller's next packet
        # would be dropped. Once, a decoder started right after the carrier found no link.
        deadline = time.monotonic() + 10
        while not all(self.net.running(h.ns, LINK) for h in (self.p, self.d)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{LINK} is not running 10 s after link up")
            time.sleep(0.05)

    def limit(self, rate: str, burst: str = "64kb", latency: str = "200ms") -> None:
        """A token bucket (``tc tbf``) on both ends of the link: ``rate`` as tc reads it
        (``100mbit``). This kernel has no netem, so no added delay or loss."""
        for h in (self.p, self.d):
            self.net.tbf(h.ns, LINK, rate, burst, latency)

    def unlimit(self) -> None:
        for h in (self.p, self.d):
            self.net.no_qdisc(h.ns, LINK)
