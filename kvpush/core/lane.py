"""The completion lane: a same-host shortcut for a direct copy's completion.

D creates a small shared-memory file of 64-bit words (``/dev/shm/kvpush-lane-<hex>``)
and names it in its handshake (``AgentInfo.lane``). For each registration a
same-host P rank may copy into, D reserves one word and sends ``(slot, gen)`` in
that rank's PUSH_REG (``wire.LaneSlot``); ``gen`` is fresh for every reservation.
P's copy writes ``gen`` into the word once every byte has landed (the GPU writes
it from the copy kernel itself), and D reads the word whenever it polls: no NIXL
notification between the last byte and D seeing it.

A word holding anything but its ``gen`` means "not yet": a late write meant for
an earlier reservation of the slot cannot complete a later one. Free slots are
reused oldest first, so a slot whose reservation ended without P's word (a
watchdog expiry) is the last to be handed out again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import socket
import stat
import time
import uuid
from collections import deque
from typing import Any

import numpy as np

from kvpush.core.errors import ConfigError

log = logging.getLogger(__name__)

LANE_DIR = "/dev/shm"
NAME_RE = re.compile(r"kvpush-lane-[0-9a-f]{32}")
HALF_RE = re.compile(r"kvpush-lane-[0-9a-f]{32}\.new")  # made, not yet locked and renamed
HALF_GRACE_S = 60.0  # a half-made lane this old has no owner any more (it is made in ms)
MAX_SLOTS = 1 << 20
_VECTOR_FROM = 16  # waiting words checked one by one below this, with numpy above


def host_identity() -> str:
    """Same string for every process that can take the same-host shortcuts with us: one
    booted host (hostname, boot id), one network namespace and one ``/dev/shm``. A
    process in another network namespace or with a private ``/dev/shm`` (a container, a
    test host) counts as another host: it cannot open our lane, and its P WRITEs over
    the network instead of copying into us."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        net = 0
    try:
        shm = os.stat(LANE_DIR).st_dev
    except OSError:
        shm = 0
    return f"{socket.gethostname()}/{boot}/net:{net}/shm:{shm}"


def lane_path(name: str) -> str:
    """The file of a lane named by a peer; raises ConfigError for anything but a lane name
    (a peer's handshake must not make us open, let alone write, another file)."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ConfigError(f"not a kvpush lane name: {name!r}")
    return os.path.join(LANE_DIR, name)


def remove_stale_lanes(directory: str = LANE_DIR) -> list[str]:
    """Unlink our user's lanes whose owner is gone (a decoder killed before its cleanup):
    a live owner holds an exclusive lock on its lane for as long as it runs, in any pid
    namespace. Half-made ones (``.new``: the owner died between creating and renaming
    it) go too once unlocked and older than HALF_GRACE_S. Returns the names removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if NAME_RE.fullmatch(n) or HALF_RE.fullmatch(n)]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or another user's
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                continue
            if HALF_RE.fullmatch(name) and now - st.st_mtime < HALF_GRACE_S:
                continue  # may be in the making (unlocked for a moment)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its owner is alive
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(name)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d lane(s) left by decoders that died: %s", len(removed), removed)
    return removed


def _made_locked(path: str, size: int) -> int:
    """The fd of a new file at ``path``, locked and ``size`` bytes long, never visible
    under ``path`` unlocked. Where the kernel cannot make a nameless file (O_TMPFILE), it
    is made as ``path.new`` (remove_stale_lanes clears those a crash leaves)."""
    directory = os.path.dirname(path)
    try:
        fd = os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            # linkat(AT_SYMLINK_FOLLOW) (a dir fd makes Python call it): a crash before
            # this leaves nothing behind.
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                name = os.path.basename(path)
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
            finally:
                os.close(dir_fd)
            return fd
        except OSError as e:
            os.close(fd)
            log.debug("nameless lane file failed (%s); making it under a temporary name", e)
    tmp = f"{path}.new"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)  # (a full /dev/shm, an interrupt) leave nothing behind
        os.close(fd)
        raise
    return fd


class CompletionLane:
    """D's lane: reserve a word per (registration, P rank), see which were written."""

    def __init__(self, slots: int = 1 << 16) -> None:
        if not 0 < slots <= MAX_SLOTS:
            raise ConfigError(f"lane_slots must be in [1, {MAX_SLOTS}], got {slots}")
        remove_stale_lanes()
        self.name = f"kvpush-lane-{uuid.uuid4().hex}"
        self.path = lane_path(self.name)
        # A lane under its real name is always locked by a live owner (remove_stale_lanes
        # relies on it): made nameless, locked and sized, then linked under its name.
        self._fd = _made_locked(self.path, slots * 8)  # held open: the lane is in use
        fd = self._fd
        try:
            self._mm = mmap.mmap(fd, slots * 8)
        except OSError:
            os.unlink(self.path)
            os.close(fd)
            raise
        self._words: Any = memoryview(self._mm).cast("Q")  # one word: a plain int read
        self._array: Any = np.frombuffer(self._mm, dtype=np.uint64)
        self._free: deque[int] = deque(range(slots))
        self._gen = 0
        self.waiting: dict[int, tuple[int, Any]] = {}  # slot -> (gen, key)
        self._vec: tuple[np.ndarray, np.ndarray, list[int]] | None = None

    def reserve(self, key: Any) -> tuple[int, int] | None:
        """A word for ``key``: (slot, gen), or None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._gen += 1
        self.waiting[slot] = (self._gen, key)
        self._vec = None
        return slot, self._gen

    def release(self, slot: int) -> None:
        if self.waiting.pop(slot, None) is not None:
            self._free.append(slot)
            self._vec = None

    def poll(self) -> list[Any]:
        """The keys whose word holds their gen; their slots are released."""
        if not self.waiting:
            return []
        if len(self.waiting) < _VECTOR_FROM:
            words = self._words
            hit = [s for s, (gen, _) in self.waiting.items() if words[s] == gen]
        else:
            if self._vec is None:
                order = list(self.waiting)
                want = [self.waiting[s][0] for s in order]
                self._vec = (np.array(order), np.array(want, dtype=np.uint64), order)
            idx, gen_arr, slots = self._vec
            hit = [slots[i] for i in np.flatnonzero(self._array[idx] == gen_arr).tolist()]
        keys = [self.waiting[s][1] for s in hit]
        for s in hit:
            self.release(s)
        return keys

    def close(self) -> None:
        self._words.release()
        self._array = None
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1


class LaneView:
    """P's view of a peer's lane: set a word (CPU hooks) or hand its memory to a device."""

    def __init__(self, name: str) -> None:
        path = lane_path(name)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= 8 * MAX_SLOTS:
                raise ConfigError(f"lane {name} is not a lane file ({st.st_size} bytes)")
            if st.st_size % 8:
                raise ConfigError(f"lane {name} is {st.st_size} bytes, not whole words")
            self.mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        self.slots = st.st_size // 8
        self.words: Any = memoryview(self.mm).cast("Q")

    def address(self) -> int:
        """Where the words are mapped in this process."""
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def set(self, slot: int, gen: int) -> None:
        self.words[slot] = gen

    def close(self) -> None:
        self.words.release()
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
