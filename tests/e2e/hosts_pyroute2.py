"""The test hosts' networking (tests/e2e/hosts.py's ``Net``) through netlink with pyroute2,
for machines without iproute2's ``ip``/``tc`` (the GPU machine: a pure-Python wheel).

Commands enter a namespace with a small Python launcher (setns(2) by ctypes, so Python
3.11 works too, then exec), not ``ip netns exec``; like that, they then mount a sysfs of
the namespace on /sys in their own mount namespace (UCX reads /sys/class/net).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from pyroute2 import IPRoute, netns
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import TC_H_ROOT
from pyroute2.netlink.rtnl.tcmsg.common import get_size

CLONE_NEWNET = 0x40000000
IFF_RUNNING = 0x40  # operationally up (what UCX checks)
# argv: NETNS_FILE COMMAND...; enters the network namespace, then becomes COMMAND.
LAUNCHER = (
    "import ctypes, os, sys\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    f"if ctypes.CDLL(None, use_errno=True).setns(fd, {CLONE_NEWNET}) != 0:\n"
    "    raise OSError(ctypes.get_errno(), 'setns ' + sys.argv[1])\n"
    "os.close(fd)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
SYSFS = 'mount -t sysfs sysfs /sys || echo "kvpush hosts: /sys is the root namespace\'s" >&2; '


def ns_path(ns: str) -> str:
    return os.path.join(netns.NETNS_RUN_DIR, ns)


def _ipr(ns: str | None) -> IPRoute:
    if ns is not None and not os.path.exists(ns_path(ns)):
        raise FileNotFoundError(ns_path(ns))  # IPRoute(netns=...) would create it
    return IPRoute(netns=ns) if ns else IPRoute()


def _index(ipr: IPRoute, dev: str) -> int:
    found = ipr.link_lookup(ifname=dev)
    if not found:
        raise RuntimeError(f"no device {dev}")
    return int(found[0])


class Pr2Net:
    """tests/e2e/hosts.py's ``Net`` by netlink (pyroute2) and a Python namespace launcher."""

    def tools(self) -> list[str]:
        return [t for t in ("unshare", "mount", "sh") if shutil.which(t) is None]

    def run_in(self, ns: str) -> list[str]:
        """A command prefix that runs the rest in ``ns``'s network namespace (only)."""
        return [sys.executable, "-c", LAUNCHER, ns_path(ns)]

    def enter(self, ns: str, mount_script: str) -> list[str]:
        return [*self.run_in(ns), "unshare", "--mount", "--propagation", "private",
                "sh", "-c", SYSFS + mount_script, "sh"]  # fmt: skip

    def add_ns(self, ns: str) -> None:
        netns.create(ns)

    def del_ns(self, ns: str) -> None:
        if not os.path.exists(ns_path(ns)):
            return
        for pid in netns.ns_pids().get(ns, []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        netns.remove(ns)  # the namespace, and the veth ends in it, go with its last user

    def veth(self, ns: str | None, name: str, peer_ns: str, peer: str) -> None:
        with _ipr(ns) as ipr:
            ipr.link("add", ifname=name, kind="veth", peer={"ifname": peer, "net_ns_fd": peer_ns})

    def del_link(self, name: str) -> None:
        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=name):
                ipr.link("del", index=index)

    def addr(self, ns: str | None, dev: str, cidr: str) -> None:
        address, _, bits = cidr.partition("/")
        with _ipr(ns) as ipr:
            ipr.addr("add", index=_index(ipr, dev), address=address, prefixlen=int(bits))

    def set_up(self, ns: str | None, dev: str, up: bool) -> None:
        with _ipr(ns) as ipr:
            ipr.link("set", index=_index(ipr, dev), state="up" if up else "down")

    def running(self, ns: str, dev: str) -> bool:
        with _ipr(ns) as ipr:
            return bool(ipr.get_links(_index(ipr, dev))[0]["flags"] & IFF_RUNNING)

    def sysctl(self, ns: str, key: str, value: int) -> None:
        # /proc/sys/net is the opening process's namespace's: write it from inside.
        path = "/proc/sys/" + key.replace(".", "/")
        subprocess.run([*self.run_in(ns), "sh", "-c", f"echo {value} > {path}"], check=True)

    def tbf(self, ns: str, dev: str, rate: str, burst: str, latency: str) -> None:
        # pyroute2 reads rate ("200mbit") and latency ("2s") as tc does, burst only in bytes.
        with _ipr(ns) as ipr:
            ipr.tc("replace", "tbf", _index(ipr, dev), rate=rate, burst=int(get_size(burst)),
                   latency=latency)  # fmt: skip

    def no_qdisc(self, ns: str, dev: str) -> None:
        with _ipr(ns) as ipr:
            try:
                ipr.tc("del", index=_index(ipr, dev), parent=TC_H_ROOT)  # `root`
            except NetlinkError:
                pass  # none there, as `tc qdisc del` without one

    def counter(self, ns: str, dev: str, name: str) -> int:
        with _ipr(ns) as ipr:
            return int(ipr.get_links(_index(ipr, dev))[0].get_attr("IFLA_STATS64")[name])
