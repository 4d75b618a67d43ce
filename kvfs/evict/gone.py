"""The ghosts of gone files, by name: what the policy remembered of a file evicted or
removed, kept so that the chunk written again under its name inherits it
(``Evictor.forget`` / ``Evictor.committed``).

There are as many as files are tracked, so their cost per entry is the evictor's
cost per file after the cache has turned over (issue 30: ~130 B each as a dict of
Python ints). Here they are spread by name over :data:`SHARDS` small tables (one
while there are few), each flat arrays in insertion order (the name, and the ghost's
four 64-bit fields narrowed to 32 bits each: 24 B a slot; a ghost with a wider field
is kept whole beside them) and an open-addressing index of slot numbers (4 B a slot,
at most 70 % full, linear probing): 40-60 B per name, depending on where a table is
between two rebuilds. A table is rebuilt whole (its live entries compacted, its
index sized anew) in Python, so the shards keep one rebuild short: 10^8 gone names
are ~25 000 per shard, tens of ms.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_EMPTY = 0
"""An index value: no slot ever here; otherwise the slot's position + 1 in the arrays.
A dropped entry keeps its index value (its array name is -1, which no name matches):
probes go on past it, and the next rebuild leaves it out."""
_MIN_CAPACITY = 16
_SHARD_BITS = 12
SHARDS = 1 << _SHARD_BITS
"""Tables, by a name's low bits; each keeps its oldest-first order, so the oldest
dropped is the oldest of its table (names are hashes: the tables fill evenly)."""
SPLIT_AT = 16384
"""The bound beyond which the names are split into SHARDS tables: below it one table
keeps the bound exactly, and its rebuild is a few ms."""
_SHARD_MIN = 8
"""Entries a table may keep whatever its share of the bound (a pool that shrank after
the split keeps at most SHARDS * _SHARD_MIN)."""


def _capacity(live: int) -> int:
    """The index size for ``live`` names: a power of two, at least twice as many."""
    cap = _MIN_CAPACITY
    while cap < 2 * live:
        cap *= 2
    return cap


_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_WIDE = _U64
"""Both halves of a slot's ghost when it is kept whole (in ``_Shard._wide``): no
narrowed ghost has them, its fields being below 2**32 - 1."""


def _narrow(ghost: int) -> tuple[int, int] | None:
    """A ghost's four 64-bit fields (bits 0, 64, 128, 192) as 32-bit ones in two
    64-bit halves, or None if one of them does not fit."""
    f0, f1, f2, f3 = ghost & _U64, ghost >> 64 & _U64, ghost >> 128 & _U64, ghost >> 192
    if max(f0, f1, f2, f3) >= _U32:
        return None
    return f0 | f1 << 32, f2 | f3 << 32


def _widen(lo: int, hi: int) -> int:
    return (lo & _U32) | (lo >> 32) << 64 | (hi & _U32) << 128 | (hi >> 32) << 192


class GoneNames:
    """Name (a non-negative int below 2**63) -> ghost (a policy's ``take_ghost``: four
    unsigned 64-bit fields at bits 0, 64, 128 and 192), at most ``most`` of them
    (:meth:`put`), the oldest dropped first; an entry put again moves to the newest
    end. One table, so exactly that, until ``most`` first exceeds :data:`SPLIT_AT`;
    then :data:`SHARDS` tables, each holding its share of ``most`` (at least
    :data:`_SHARD_MIN`), so the oldest dropped is the oldest of its table."""

    def __init__(self) -> None:
        self._shards: list[_Shard | None] = [None]
        self._bits = 0  # then _SHARD_BITS: a name's low bits pick its table
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def pop(self, name: int) -> int | None:
        """The ghost kept under ``name``, forgotten; None if there is none."""
        shard = self._shards[name & ((1 << self._bits) - 1)]
        if shard is None:
            return None
        ghost = shard.pop(name >> self._bits)
        if ghost is not None:
            self._live -= 1
        return ghost

    def put(self, name: int, ghost: int, most: int) -> None:
        """Keep ``ghost`` under ``name`` as the newest entry, then drop the oldest
        while more than ``most`` are kept (in a table: more than its share)."""
        if not 0 <= name < 1 << 63 or not 0 <= ghost < 1 << 256:
            raise ValueError(f"a name below 2**63 and a 256-bit ghost, not {name}, {ghost}")
        if most > SPLIT_AT and not self._bits:
            self._split()
        bits = self._bits
        i = name & ((1 << bits) - 1)
        shard = self._shards[i]
        if shard is None:
            shard = self._shards[i] = _Shard()
        before = len(shard)
        shard.put(name >> bits, ghost)
        shard.trim(max(_SHARD_MIN, -(-most // SHARDS)) if bits else most)
        self._live += len(shard) - before

    def _split(self) -> None:
        """From one table to :data:`SHARDS`, each entry put again oldest first."""
        one = self._shards[0]
        self._shards = [None] * SHARDS
        self._bits = _SHARD_BITS
        self._live = 0
        for name, ghost in one.items() if one is not None else ():
            self.put(name, ghost, 1 << 62)


class _Shard:
    """One table: names (a GoneNames name's high bits) -> ghosts, oldest first."""

    def __init__(self) -> None:
        self._names = array("q")
        """By age, oldest first from ``_head``; -1: an entry popped from the middle."""
        self._lo = array("Q")
        self._hi = array("Q")
        self._wide: dict[int, int] = {}  # name -> a ghost a field of which is too wide
        self._head = 0
        self._live = 0
        self._used = 0  # index slots that are not _EMPTY (live and dropped entries)
        self._index = array("i", bytes(4 * _MIN_CAPACITY))
        self._mask = _MIN_CAPACITY - 1

    def __len__(self) -> int:
        return self._live

    def _find(self, name: int) -> int:
        """The array position of ``name``'s entry, or -1."""
        index, names, mask = self._index, self._names, self._mask
        i = name & mask
        while True:
            at = index[i]
            if at == _EMPTY:
                return -1
            if names[at - 1] == name:
                return at - 1
            i = (i + 1) & mask

    def _drop(self, at: int) -> None:
        """Forget the entry at array position ``at``."""
        if self._wide and self._lo[at] == _WIDE == self._hi[at]:
            del self._wide[self._names[at]]
        self._names[at] = -1
        self._live -= 1

    def pop(self, name: int) -> int | None:
        at = self._find(name)
        if at < 0:
            return None
        lo, hi = self._lo[at], self._hi[at]
        ghost = self._wide[name] if lo == _WIDE == hi else _widen(lo, hi)
        self._drop(at)
        return ghost

    def put(self, name: int, ghost: int) -> None:
        at = self._find(name)
        if at >= 0:
            self._drop(at)
        if (
            self._used + 1 > self._mask * 7 // 10
            or len(self._names) >= 2 * self._live + _MIN_CAPACITY
        ):
            self._rebuild(self._live + 1)
        halves = _narrow(ghost)
        if halves is None:
            self._wide[name] = ghost
            halves = (_WIDE, _WIDE)
        self._names.append(name)
        self._lo.append(halves[0])
        self._hi.append(halves[1])
        self._place(name, len(self._names))
        self._live += 1

    def _place(self, name: int, at: int) -> None:
        index, mask = self._index, self._mask
        i = name & mask
        while index[i] != _EMPTY:
            i = (i + 1) & mask
        index[i] = at
        self._used += 1

    def trim(self, most: int) -> None:
        """Drop the oldest entries until at most ``most`` are left."""
        names = self._names
        while self._live > most:
            if names[self._head] >= 0:
                self._drop(self._head)
            self._head += 1

    def _rebuild(self, live: int) -> None:
        """The live entries, oldest first, in fresh arrays; an index sized for ``live``."""
        keep = [i for i in range(self._head, len(self._names)) if self._names[i] >= 0]
        self._names = array("q", (self._names[i] for i in keep))
        self._lo = array("Q", (self._lo[i] for i in keep))
        self._hi = array("Q", (self._hi[i] for i in keep))
        self._head = 0
        cap = _capacity(live)
        self._index = array("i", bytes(4 * cap))
        self._mask = cap - 1
        self._used = 0
        for at, name in enumerate(self._names, 1):
            self._place(name, at)

    def items(self) -> Iterator[tuple[int, int]]:
        """(name, ghost), oldest first."""
        for at in range(self._head, len(self._names)):
            name = self._names[at]
            if name >= 0:
                lo, hi = self._lo[at], self._hi[at]
                yield name, self._wide[name] if lo == _WIDE == hi else _widen(lo, hi)
