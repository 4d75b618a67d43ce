"""The orphan list: the files whose last user is gone, in the order they became
orphans (evicted first, ``docs/eviction.md``), kept by the evictor
(:mod:`kvfs.evict.evictor`). Pure and synchronous."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from kvfs.evict.slots import runs


class OrphanList:
    """An insertion-ordered set of inode numbers: an intrusive circular doubly
    linked list in two int32 arrays indexed by inode number (8 bytes per inode up
    to the highest, no Python object per member). Inode 0 (never a file) is the
    sentinel; ``prev`` is -1 for a non-member. What a ``dict`` of keys to None did,
    in 8 instead of ~100 bytes per file."""

    __slots__ = ("count", "next", "prev")

    def __init__(self) -> None:
        self.prev = array("i", [0])
        self.next = array("i", [0])
        self.count = 0

    def _grow(self, ino: int) -> None:
        n = max(ino + 1, len(self.prev) + (len(self.prev) >> 3), 1024) - len(self.prev)
        self.prev.extend(array("i", [-1]) * n)
        self.next.extend(array("i", [-1]) * n)

    def __contains__(self, ino: object) -> bool:
        return isinstance(ino, int) and 0 < ino < len(self.prev) and self.prev[ino] >= 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[int]:
        """Members oldest first (the list must not change meanwhile)."""
        nxt = self.next
        ino = nxt[0]
        while ino:
            yield ino
            ino = nxt[ino]

    def add(self, ino: int) -> None:
        """Append ``ino`` (no-op for a member: it keeps its place, as in a dict)."""
        if ino <= 0:
            raise ValueError(f"no orphan list entry for inode {ino}")
        if ino >= len(self.prev):
            self._grow(ino)
        elif self.prev[ino] >= 0:
            return
        tail = self.prev[0]
        self.prev[ino] = tail
        self.next[ino] = 0
        self.next[tail] = ino
        self.prev[0] = ino
        self.count += 1

    def pop(self, ino: int, default: None = None) -> None:
        """Remove ``ino`` if it is a member."""
        if ino in self:
            before, after = self.prev[ino], self.next[ino]
            self.next[before] = after
            self.prev[after] = before
            self.prev[ino] = self.next[ino] = -1
            self.count -= 1

    def extend(self, inos: array[int], spans: list[tuple[int, int]] | None = None) -> None:
        """``add`` each of ``inos`` (distinct, none a member yet), in order: slice
        writes per run of consecutive numbers (a mount's 10^7 orphans)."""
        n = len(inos)
        if not n:
            return
        if self.count:
            for ino in inos:
                self.add(ino)
            return
        if min(inos) <= 0:
            raise ValueError("no orphan list entry for inode 0")
        top = max(inos)
        if top >= len(self.prev):
            self._grow(top)
        prev, nxt = self.prev, self.next
        tail = prev[0]
        for i, j in runs(inos) if spans is None else spans:
            first = inos[i]
            k = j - i
            nxt[tail] = first
            prev[first : first + k] = array("i", range(first - 1, first + k - 1))
            prev[first] = tail
            nxt[first : first + k] = array("i", range(first + 1, first + k + 1))
            tail = first + k - 1
        nxt[tail] = 0
        prev[0] = tail
        self.count += n
