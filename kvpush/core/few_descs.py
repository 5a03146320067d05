"""Descriptors of a short push with builtins: ``routing._uniform_descs`` for a few rows.

A short prompt's push moves a few blocks; numpy's per-call cost (a dozen calls, most of
all on the cold caches at the end of a prefill) is then more than the rows themselves,
so the rows stay a list of tuples, which NIXL takes as they are. They are the same as
the numpy path's, in the same order (tests/unit/test_routing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpush.core.layout import KVLayout, RegionPair
from kvpush.core.transport import Rows

SHORT_ROWS = 64  # up to this many descriptors, builtins beat numpy's per-call cost


def few_uniform_descs(
    p: KVLayout, d: KVLayout, pairs: Sequence[RegionPair], s_ids: Any, d_ids: Any
) -> tuple[Rows, Rows]:
    """Nx3 (address, length, device) rows, pair by pair, one per run of physical blocks
    contiguous on both sides (in P's order); every pair moves whole blocks of one size."""
    runs: list[list[int]] = []  # [first P id, first D id, count], physical
    # In P's order, as routing.in_source_order: descending runs on both sides merge too.
    for s, t in sorted(zip(_physical(s_ids, p), _physical(d_ids, d), strict=True)):
        if runs and s == runs[-1][0] + runs[-1][2] and t == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, t, 1])
    if not runs:  # (an empty list gives NIXL no row to tell its format by)
        empty = np.zeros((0, 3), dtype=np.int64)
        return empty, empty.copy()
    src: list[tuple[int, int, int]] = []
    dst: list[tuple[int, int, int]] = []
    for x in pairs:
        lr, rr = p.regions[x.src], d.regions[x.dst]
        n = lr.block_len
        for s, t, count in runs:
            src.append((lr.base_addr + s * n, count * n, lr.device_id))
            dst.append((rr.base_addr + t * n, count * n, rr.device_id))
    return src, dst


def _physical(ids: Any, layout: KVLayout) -> list[int]:
    ratio = layout.physical_per_logical
    logical = ids.tolist() if isinstance(ids, np.ndarray) else list(map(int, ids))
    return [b * ratio + k for b in logical for k in range(ratio)]
