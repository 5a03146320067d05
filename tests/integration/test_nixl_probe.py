"""NIXL connects inside add_remote_agent, and waits there for the peer's address to answer:
3 s where nobody answers ARP, over 2 min where the path drops packets. The handshake
thread tries that connection first (``NixlTransport.probe``) on an agent of its own, so
the agent the ticking thread uses is never held by it (issue 37).

Two test hosts (tests/e2e/hosts.py; needs root): agent B on D's host, whose kernel stops
answering ARP; on P's host a real NixlTransport probes B from a thread while its own
agent keeps being polled, then probes B again once B answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.e2e.hosts import HostPair

pytestmark = pytest.mark.integration

SERVE_B = """
import sys
from kvpush.core.nixl_transport import NixlTransport
b = NixlTransport("B-tp0-00000000")
sys.stdout.buffer.write(b.metadata().hex().encode() + b"\\n"); sys.stdout.flush()
sys.stdin.read()  # until the test is done
b.close()
"""

PROBE = """
import json, sys, threading, time
from kvpush.core.errors import TransportError
from kvpush.core.nixl_transport import NixlTransport
metadata = bytes.fromhex(sys.argv[1])
a = NixlTransport("A-tp0-00000000")
outcome = {}

def probe():
    started = time.monotonic()
    try:
        a.probe(metadata)
        outcome["error"] = ""
    except TransportError as e:
        outcome["error"] = str(e)
    outcome["probe_s"] = time.monotonic() - started

t = threading.Thread(target=probe)
t.start()
worst = 0.0
while t.is_alive():  # the ticking thread's calls on our own agent, meanwhile
    started = time.monotonic()
    a.get_notifs()
    worst = max(worst, time.monotonic() - started)
    time.sleep(0.005)
outcome["worst_poll_s"] = worst
print(json.dumps(outcome))
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[HostPair]:
    with HostPair(prefix="kvprobe", net=79) as h:
        yield h


def probe_from_p(hosts: HostPair, metadata: str) -> dict[str, float | str]:
    got = subprocess.run(
        [*hosts.p.prefix(), sys.executable, "-c", PROBE, metadata],
        env={**_env(), **HostPair.env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}


def test_a_probe_waits_on_its_own_agent_not_on_ours(hosts: HostPair) -> None:
    b = subprocess.Popen(
        [*hosts.d.prefix(), sys.executable, "-c", SERVE_B],
        env={**_env(), **HostPair.env()},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert b.stdout is not None
        metadata = b.stdout.readline().strip()
        assert metadata, "agent B did not start"
        # D's host stops answering ARP before P ever reached it: P's connect waits for
        # the neighbour lookup to fail.
        hosts.net.sysctl(hosts.d.ns, "net.ipv4.conf.all.arp_ignore", 8)
        started = time.monotonic()
        dark = probe_from_p(hosts, metadata)
        assert "probe" in str(dark["error"]), dark
        assert 1.0 < float(dark["probe_s"]) < 20.0, dark  # it did wait
        assert float(dark["worst_poll_s"]) < 0.2, dark  # our own agent did not
        assert time.monotonic() - started < 30.0
        hosts.net.sysctl(hosts.d.ns, "net.ipv4.conf.all.arp_ignore", 0)
        lit = probe_from_p(hosts, metadata)
        assert lit["error"] == "" and float(lit["probe_s"]) < 2.0, lit
    finally:
        hosts.net.sysctl(hosts.d.ns, "net.ipv4.conf.all.arp_ignore", 0)
        if b.stdin is not None:
            b.stdin.close()
        b.wait(timeout=30)
