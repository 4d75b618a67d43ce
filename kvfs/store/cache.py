"""Clean unit cache: an LRU of verified device data, bounded in bytes. Pure."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStatistics:
    bytes: int
    capacity: int
    hits: int
    misses: int


class UnitCache:
    """Maps (inode, logical unit) to a read-only view of that unit's bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = 0

    def get(self, key: tuple[int, int]) -> memoryview | None:
        view = self._items.get(key)
        if view is None:
            self._misses += 1
            return None
        self._items.move_to_end(key)
        self._hits += 1
        return view

    def __contains__(self, key: object) -> bool:
        """A probe that neither counts as a hit or miss nor refreshes the entry."""
        return key in self._items

    def put(self, key: tuple[int, int], view: memoryview) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self._items[key] = view
        self._bytes += len(view)
        while self._bytes > self.capacity and self._items:
            _, evicted = self._items.popitem(last=False)
            self._bytes -= len(evicted)

    def discard(self, key: tuple[int, int]) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= len(old)

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(self._bytes, self.capacity, self._hits, self._misses)
