"""LRU: every write or read makes a key the newest; evict the least recently used."""

from __future__ import annotations

from collections.abc import Hashable

from kvfs.evict.policy.fifo import FIFOPolicy
from kvfs.format import policy_image as img


class LRUPolicy(FIFOPolicy):
    """Least recently used: every track or touch makes a key the newest."""

    name = "lru"
    _kind = img.KIND_LRU

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; it counts as a use."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is None:
            slot = self._add(key, size)
        else:
            self._resize(slot, size)
            self._slots.unlink(slot)
        self._slots.append(self._order, slot)

    def touch(self, key: int, stream: Hashable) -> None:
        """Record a read: ``key`` becomes the newest."""
        slot = self._slot(key)
        if slot is not None:
            self._touches += 1
            self._slots.unlink(slot)
            self._slots.append(self._order, slot)
