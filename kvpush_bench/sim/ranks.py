"""KV memory of one simulated rank: any TP / PP position, standard or MLA, packed or not.

Every head page (one layer, K or V, one KV head, one block) holds bytes derived from
(request key, layer, K/V, global head, position in the request), so P ranks and D ranks
of different shapes agree on what each byte must be.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from kvpush.core.layout import KVLayout, PackedMember, Region


@dataclass(frozen=True)
class RankShape:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    kv_heads: int = 1  # total KV heads of the model (standard attention)
    mla: bool = False
    packed: bool = False  # MLA pages of all layers in one row per block

    def layers(self, total: int) -> list[int]:
        per = total // self.pp_size
        return list(range(self.pp_rank * per, (self.pp_rank + 1) * per))


@dataclass(frozen=True)
class Place:
    """One head page inside a region's block."""

    region: int
    layer: int
    kv: int  # 0 = K, 1 = V (always 0 for MLA)
    head: int  # global KV head (0 for MLA)
    offset: int
    nbytes: int


def page(key: str, layer: int, kv: int, head: int, n_blocks: int, nbytes: int) -> np.ndarray:
    """The bytes of one head page for positions 0..n_blocks-1 of a request."""
    seed = zlib.crc32(f"{key}/{layer}/{kv}/{head}".encode())
    words = -(-n_blocks * nbytes // 8)
    with np.errstate(over="ignore"):
        vals = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        vals += np.uint64(seed << 24)
    return vals.view(np.uint8)[: n_blocks * nbytes].reshape(n_blocks, nbytes)


class RankMemory:
    """The KV cache of one rank as numpy arrays, its KVLayout and its head pages."""

    def __init__(
        self, shape: RankShape, layers: int, num_blocks: int, block_bytes: int, block_size: int
    ) -> None:
        self.shape = shape
        s = shape
        own = s.layers(layers)
        specs: list[tuple[str, int, list[Place], list[PackedMember], int]] = []
        if s.packed:
            row = [
                PackedMember(f"layer{li}", k * block_bytes, block_bytes) for k, li in enumerate(own)
            ]
            places = [Place(0, li, 0, 0, k * block_bytes, block_bytes) for k, li in enumerate(own)]
            specs.append(("rows", block_bytes * len(own), places, row, 0))
        elif s.mla:
            for li in own:
                r = len(specs)
                specs.append(
                    (f"layer{li}", block_bytes, [Place(r, li, 0, 0, 0, block_bytes)], [], 0)
                )
        else:
            local = s.kv_heads // s.tp_size
            head_bytes = block_bytes // s.kv_heads
            for li in own:
                for kv in (0, 1):
                    r = len(specs)
                    places = [
                        Place(r, li, kv, s.tp_rank * local + h, h * head_bytes, head_bytes)
                        for h in range(local)
                    ]
                    specs.append((f"layer{li}.{'kv'[kv]}", local * head_bytes, places, [], local))
        self.arrays = [np.zeros((num_blocks, blen), dtype=np.uint8) for _, blen, *_ in specs]
        self.places = [p for _, _, places, _, _ in specs for p in places]
        regions = [
            Region(name, arr.ctypes.data, blen, num_blocks, kv_heads=heads, packed=row)
            for (name, blen, _, row, heads), arr in zip(specs, self.arrays, strict=True)
        ]
        self.layout = KVLayout(
            regions=regions,
            block_size=block_size,
            tp_rank=s.tp_rank,
            tp_size=s.tp_size,
            pp_rank=s.pp_rank,
            pp_size=s.pp_size,
            attention="mla" if s.mla else "standard",
            backends=["SIM_MLA"] if s.mla else [],
        )

    def fill(self, key: str, blocks: list[int]) -> None:
        for p in self.places:
            self.arrays[p.region][blocks, p.offset : p.offset + p.nbytes] = page(
                key, p.layer, p.kv, p.head, len(blocks), p.nbytes
            )

    def zero(self, blocks: list[int]) -> None:
        for arr in self.arrays:
            arr[blocks] = 0

    def verify(self, key: str, blocks: list[int]) -> int:
        """Number of head pages (over all blocks) whose bytes are not what P wrote."""
        bad = 0
        for p in self.places:
            got = self.arrays[p.region][blocks, p.offset : p.offset + p.nbytes]
            want = page(key, p.layer, p.kv, p.head, len(blocks), p.nbytes)
            bad += int((got != want).any(axis=1).sum())
        return bad

    @property
    def bytes_per_block(self) -> int:
        return sum(p.nbytes for p in self.places)
