"""A bounded first-fit allocator of byte ranges (staging slots), keyed by owner."""

from __future__ import annotations

import bisect


class SlotAllocator:
    """Hands out aligned, non-overlapping ranges of ``[0, capacity)``; one per key."""

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if capacity < 1 or align < 1:
            raise ValueError("capacity and align must be >= 1")
        self.capacity = capacity
        self.align = align
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted, merged
        self._used: dict[object, tuple[int, int]] = {}

    def alloc(self, key: object, nbytes: int) -> int | None:
        """Offset of a new range of ``nbytes`` for ``key``; None if none fits (or key holds one)."""
        if nbytes < 1 or key in self._used:
            return None
        size = -(-nbytes // self.align) * self.align
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                self._used[key] = (off, size)
                return off
        return None

    def free(self, key: object) -> bool:
        """Give back the range of ``key``; False if it holds none."""
        got = self._used.pop(key, None)
        if got is None:
            return False
        off, size = got
        i = bisect.bisect_left(self._free, (off, 0))
        self._free.insert(i, (off, size))
        # Merge with the right, then the left neighbour.
        if i + 1 < len(self._free) and off + size == self._free[i + 1][0]:
            size += self._free[i + 1][1]
            self._free[i] = (off, size)
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + size)
            del self._free[i]
        return True

    def get(self, key: object) -> tuple[int, int] | None:
        """(offset, aligned size) held by ``key``."""
        return self._used.get(key)

    @property
    def used_bytes(self) -> int:
        return sum(size for _, size in self._used.values())

    def __len__(self) -> int:
        return len(self._used)
