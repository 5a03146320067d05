"""The optional peer-copy hook: P copies straight into D's memory (core/copy_route.py).

On one host, GPU memory can be mapped into another process (CUDA IPC). Then one
kernel on P can read P's scattered blocks and write D's scattered blocks in a single
pass, where a NIXL WRITE pays per descriptor. Every worker with a hook advertises
``export()`` in its handshake (``AgentInfo.peer_copy``). When D registers, the copy
route hands ``prepare`` a ``CopyDst`` (D's ids, range-checked, and the peer's
``block_pieces`` rows, which a kernel expands on the device: no descriptor per block);
when P's blocks are ready, ``launch`` P's ids (``copy_src``); then it polls
``finished``. The implementation lives in ``kvpush.gpu.peer_copy``; the core never
imports torch. The hook is called on the ticking thread only (the engine's, or the
keeper in its place).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvpush.core.errors import LayoutError
from kvpush.core.layout import (
    SHORT_IDS,
    KVLayout,
    as_ids,
    group_limits,
    id_range,
    packed_ids,
    validate_block_ids,
)


@dataclass(frozen=True)
class Signal:
    """Where the copy reports its end: write ``gen`` into word ``slot`` of D's lane."""

    lane: str  # the lane's name (core/lane.py)
    slot: int
    gen: int


@dataclass(frozen=True)
class CopyDst:
    """D's half of a copy, checked once: ready before P's blocks are (``copy_dst``)."""

    pieces: np.ndarray  # Kx9 rows, PIECE_COLUMNS
    dst: list[np.ndarray]  # the peer's ids, per group; pieces pair src[g] with dst[g']
    dst_max: list[int]  # the largest of dst[g] (-1 when empty): what the hook bounds-checks
    signal: Signal | None  # None: the hook waits and the core sends the completion
    # One group each side (the common case): every row pairs src[0] with dst[0].
    single: bool
    row_bytes: list[int]  # bytes each row moves per block
    block_bytes: int  # their sum


def copy_dst(
    d: KVLayout | list[int],
    pieces: np.ndarray,
    dst_groups: Sequence[np.ndarray],
    signal: Signal | None = None,
) -> CopyDst:
    """D's ids as arrays, range-checked against D's layout (or its ``group_limits``).

    Ranges only: D's ids were deduplicated on arrival (a decoded PUSH_REG).
    """
    dst = [as_ids(g) for g in dst_groups]
    dst_max = validate_block_ids(d, dst, unique_known=True)
    single = len(dst) == 1 and not pieces[:, 7:9].any()
    row_bytes = pieces[:, 6].tolist()
    return CopyDst(pieces, dst, dst_max, signal, single, row_bytes, sum(row_bytes))


def copy_src(
    p: KVLayout | list[int], cd: CopyDst, src_groups: Sequence[Sequence[int] | np.ndarray]
) -> tuple[list[Sequence[int] | np.ndarray], int]:
    """Our ids, range-checked and matched with D's group sizes; and the bytes they move.

    The ids come back as given (a list or an int64 array): the hook copies them once.
    A repeated id of our own could only copy one of our blocks twice, never outside
    D's registered blocks.
    """
    limits = p if isinstance(p, list) else group_limits(p)
    if cd.single and len(src_groups) == 1 and len(limits) == 1:
        ids, nbytes = single_src(limits[0], cd, src_groups[0])
        return [ids], nbytes
    src = [as_ids(g) for g in src_groups]
    validate_block_ids(limits, src, unique_known=True)
    nbytes = 0
    for row, n in zip(cd.pieces.tolist(), cd.row_bytes, strict=True):
        sg, dg = row[7], row[8]
        if len(src[sg]) != len(cd.dst[dg]):
            have, want = len(src[sg]), len(cd.dst[dg])
            raise LayoutError(f"group {sg}: {have} source blocks, {want} destination")
        nbytes += n * len(src[sg])
    return list(src), nbytes


def single_src(
    limit: int, cd: CopyDst, ids: Sequence[int] | np.ndarray
) -> tuple[Sequence[int] | np.ndarray, int]:
    """``copy_src`` for one group each side (``cd.single``), P's ids below ``limit``; the
    last ``len(cd.dst[0])`` of ``ids`` (D may hold a prefix). Lists, and arrays of up to
    SHORT_IDS ids, come back packed as ``array("q")`` (the hook writes them with one
    memcpy); up to SHORT_IDS ids are checked with builtins: this runs at the end of a
    prefill, on cold caches, where each numpy call costs microseconds."""
    n, have = len(cd.dst[0]), len(ids)
    if have != n:
        if have < n:
            raise LayoutError(f"group 0: D registered {n} blocks, P holds {have}")
        ids = ids[have - n :]
    if not n:
        return ids, 0
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise LayoutError(f"block ids must be integers, not {ids.dtype}")
        if n > SHORT_IDS:
            _check_range(limit, *id_range(ids))
            return ids, n * cd.block_bytes
        vals: Sequence[int] = ids.tolist()
    else:
        vals = ids
    packed = packed_ids(vals)  # each must be an int: the hook copies ids, not floats
    # (id_range would turn the packed ids back into a list for the builtins)
    _check_range(limit, *((min(vals), max(vals)) if n <= SHORT_IDS else id_range(packed)))
    return packed, n * cd.block_bytes


def _check_range(limit: int, lo: int, hi: int) -> None:
    if lo < 0 or hi >= limit:
        raise LayoutError(f"group 0: block id outside [0, {limit})")


class PeerCopyHook(Protocol):
    def export(self) -> bytes:
        """What a peer on this host needs to map our KV memory (opaque to the core)."""
        ...

    def prepare(self, peer: str, exported: bytes, dst: CopyDst) -> object | None:
        """Get a copy into the peer ready before our blocks are (called when D registers).

        ``exported`` is the peer's ``export()``. None when this peer cannot be reached
        this way (another host, no mapping, a block outside what it exported).
        """
        ...

    def launch(
        self, prepared: object, src: Sequence[Sequence[int] | np.ndarray], after: object = None
    ) -> bool:
        """Start moving our blocks ``src`` (checked by ``copy_src``) into the peer's.

        ``after``: device work our blocks' bytes are final after (``StagedBlocks.after``);
        the copy must not read them before it is done (queue behind it, or wait for it).
        True: the copy runs on, and writes ``dst.signal`` once every byte has landed.
        False: it runs on without writing a signal (there is none); the producer then
        notifies the peer once ``finished`` says it is over. Either way ``launch`` does
        not wait for the copy. Raises, having written nothing, when it cannot start.
        """
        ...

    def finished(self, prepared: object) -> bool:
        """True once a launched copy is over; raises if it failed."""
        ...

    def forget(self, peer: str) -> None:
        """Drop any mapping of the peer's memory (it left or restarted)."""
        ...
