"""Matching P's and D's sides of one transfer.

P and D see different request ids for the same client request: each engine
appends its own random 8-hex suffix. The router's ``transfer_id`` is the robust
key; the seed's exact-then-base-id match is the fallback.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Generic, NamedTuple, TypeVar

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")

# ``remote_engine_id`` of a registration whose leg named no prefiller engine: any P takes
# it. ``LEGACY_ANY_ENGINE`` is what D sent in that case before (a D not yet upgraded).
ANY_ENGINE = "*"
LEGACY_ANY_ENGINE = "prefill"


def names_other_engine(named: str, engine_id: str) -> bool:
    """A registration addressed to engine ``named`` cannot be served by ``engine_id``."""
    return named not in (ANY_ENGINE, LEGACY_ANY_ENGINE, engine_id)


def base_request_id(request_id: str) -> str:
    """Strip the trailing per-engine ``-xxxxxxxx`` suffix; keep everything else."""
    return _SUFFIX.sub("", request_id)


class Key(NamedTuple):
    # A tuple: made for every finished prefill on the way to its copy, where a frozen
    # dataclass costs several times more.
    request_id: str
    transfer_id: str | None = None


V = TypeVar("V")


class MatchTable(Generic[V]):
    """Entries waiting for their other half, found by transfer id, exact id, then base id.

    Entries whose transfer ids both exist and differ never match, whatever
    their request ids. Among several base-id candidates the oldest wins.
    Single-threaded: owned by the ticking thread.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[int, tuple[Key, V]] = OrderedDict()
        self._bases: dict[int, str] = {}  # slot -> base id (a regex each; kept, not redone)
        self._by_tid: dict[str, int] = {}
        self._by_rid: dict[str, list[int]] = {}
        self._by_base: dict[str, list[int]] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return self.find(key) is not None

    def values(self) -> list[V]:
        return [v for _, v in self._entries.values()]

    def items(self) -> list[tuple[Key, V]]:
        return list(self._entries.values())

    def add(self, key: Key, value: V) -> None:
        if key.transfer_id is not None and key.transfer_id in self._by_tid:
            raise KeyError(f"transfer id {key.transfer_id} already present")
        slot = self._next
        self._next += 1
        self._entries[slot] = (key, value)
        if key.transfer_id is not None:
            self._by_tid[key.transfer_id] = slot
        self._by_rid.setdefault(key.request_id, []).append(slot)
        base = self._bases[slot] = base_request_id(key.request_id)
        self._by_base.setdefault(base, []).append(slot)

    def find(self, key: Key) -> V | None:
        slot = self._find_slot(key)
        return None if slot is None else self._entries[slot][1]

    def by_tid(self, transfer_id: str | None) -> V | None:
        """The entry of exactly this transfer id (what ``find`` tries first): one lookup."""
        slot = self._by_tid.get(transfer_id) if transfer_id is not None else None
        return None if slot is None else self._entries[slot][1]

    def find_named(self, name: str | None) -> V | None:
        """The oldest entry whose request id, without its engine suffix, is ``name``,
        whatever its transfer id (a decoder that named P's request: ``remote_request_id``)."""
        slots = self._by_base.get(name) if name else None
        return self._entries[slots[0]][1] if slots else None

    def pop_tid(self, transfer_id: str | None) -> tuple[Key, V] | None:
        """Remove and return the entry of exactly this transfer id, with its key."""
        slot = self._by_tid.get(transfer_id) if transfer_id is not None else None
        if slot is None:
            return None
        key = self._entries[slot][0]
        return key, self._remove(slot)

    def pop(self, key: Key) -> V | None:
        slot = self._find_slot(key)
        if slot is None:
            return None
        return self._remove(slot)

    def pop_value(self, value: V) -> bool:
        """Remove the entry holding exactly this value (identity)."""
        for slot, (_, v) in self._entries.items():
            if v is value:
                self._remove(slot)
                return True
        return False

    def _find_slot(self, key: Key) -> int | None:
        if key.transfer_id is not None and key.transfer_id in self._by_tid:
            return self._by_tid[key.transfer_id]
        for slot in self._by_rid.get(key.request_id, ()):
            if self._compatible(key, slot):
                return slot
        for slot in self._by_base.get(base_request_id(key.request_id), ()):
            if self._compatible(key, slot):
                return slot
        return None

    def _compatible(self, key: Key, slot: int) -> bool:
        other = self._entries[slot][0].transfer_id
        return key.transfer_id is None or other is None or other == key.transfer_id

    def _remove(self, slot: int) -> V:
        key, value = self._entries.pop(slot)
        if key.transfer_id is not None:
            self._by_tid.pop(key.transfer_id, None)
        _drop(self._by_rid, key.request_id, slot)
        _drop(self._by_base, self._bases.pop(slot), slot)
        return value


def _drop(index: dict[str, list[int]], name: str, slot: int) -> None:
    slots = index.get(name)
    if slots is None:
        return
    slots.remove(slot)
    if not slots:
        del index[name]
