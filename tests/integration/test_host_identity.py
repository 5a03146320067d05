"""host_identity: a process in another network namespace or with a private /dev/shm is
on another host (no lane, no peer copy); a plain child process is on ours. Needs root
(CI runs as root) and util-linux's unshare."""

from __future__ import annotations

import subprocess
import sys

from kvpush.core.lane import host_identity

PRINT = [sys.executable, "-c", "from kvpush.core.lane import host_identity; print(host_identity())"]


def identity_in(*wrap: str) -> str:
    out = subprocess.run([*wrap, *PRINT], check=True, capture_output=True, text=True)
    return out.stdout.strip()


def test_same_host_for_a_plain_child() -> None:
    assert identity_in() == host_identity()


def test_another_network_namespace_is_another_host() -> None:
    assert identity_in("unshare", "--net") != host_identity()


def test_a_private_dev_shm_is_another_host() -> None:
    script = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    wrap = ("unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh")
    assert identity_in(*wrap) != host_identity()
