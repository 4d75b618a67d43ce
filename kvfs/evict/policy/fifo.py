"""FIFO: evict in order of first write; reads change nothing."""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from kvfs.evict.policy.base import LinkedPolicy
from kvfs.evict.policy.protocol import PolicyStatistics
from kvfs.format import policy_image as img


class FIFOPolicy(LinkedPolicy):
    """First in, first out: evict in order of first ``track()``; reads change nothing."""

    name = "fifo"
    _kind = img.KIND_FIFO

    def track(self, key: int, size: int, stream: Hashable) -> None:
        """Record a write; a rewrite of a tracked key keeps its place."""
        self._check(key, size)
        slot = self._slot(key)
        if slot is None:
            self._slots.append(self._order, self._add(key, size))
        else:
            self._resize(slot, size)

    def touch(self, key: int, stream: Hashable) -> None:
        """Count a read; FIFO order ignores reads."""
        if self._slot(key) is not None:
            self._touches += 1

    def remove(self, key: int) -> None:
        """Forget ``key`` (no-op if unknown)."""
        slot = self._slot(key)
        if slot is not None:
            self._drop(slot)
            self._slots.release(slot)

    def victims(self) -> Iterator[int]:
        """Yield keys oldest write first; removing the yielded key is allowed."""
        return self._slots.walk(self._order)

    def statistics(self) -> PolicyStatistics:
        """Return a snapshot of the counters."""
        return self._base_statistics()
