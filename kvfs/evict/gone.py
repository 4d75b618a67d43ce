"""The ghosts of gone files, by name: what the policy remembered of a file evicted or
removed, kept so that the chunk written again under its name inherits it
(``Evictor.forget`` / ``Evictor.committed``).

There are as many as files are tracked, so their cost per entry is the evictor's
cost per file after the cache has turned over (issue 30: ~130 B each as a dict of
Python ints). Here they are spread by name over :data:`SHARDS` small tables (one
while there are few), each flat arrays in insertion order and an open-addressing
index of array positions (2 B a slot up to ~53 000 entries a table, 4 B past it;
linear probing, at most 70 % full, sized 1.75 slots per entry at each rebuild).
An entry is the name's next 32 bits above the table's (the whole name in the one
table) and the ghost's first two 64-bit fields narrowed to 32 bits each: 12 B,
~16 B with the index and the arrays' slack between two rebuilds. Field 2 (the
successor a rewrite revives) is 0 in almost every ghost, so a table keeps the few
that are not in a dict, and all of them in a 32-bit array only while they are many
(:data:`_SPARSE`). Field 3 (the loop expert's note of the file's reuse gap) is 0 in
every ghost a policy hands over (``KvfsPolicy.remove`` clears it), so it is not
kept; a ghost whose field 3 is not 0 is kept whole. (Four fields of 32 bits, as
until session 24, took 20 B, ~25 B in all: 24.1 B per file at 10^7; three, until
session 26, 16 B and 20.1 B.) The last use (field 1,
a policy's event clock, which passes 2**32 in a long-lived mount) is kept as its
distance from the table's ``base``, moved ahead of the newest last use when one
falls past it, so it stays narrow however far the clock has run. A ghost with a
field that does not fit is kept whole beside the arrays. A table is rebuilt whole
(its live entries compacted, its index sized anew) in Python, so the shards keep
one rebuild short: 10^8 gone names are ~25 000 per shard, tens of ms.

A split table compares 32 bits of a name (names are hashes): two names may meet
there once in ~2**32 probes, and the later lookup then takes the other's ghost. A
ghost is a policy's memory of a file, never its bytes, so such a meeting costs a
worse eviction order for one file at most.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_EMPTY = 0
"""An index value: no slot ever here; otherwise the slot's position + 1 in the arrays.
A dropped entry keeps its index value (its fields are marked dead, which no lookup
matches): probes go on past it, and the next rebuild leaves it out."""
_MIN_CAPACITY = 16
_SLOTS_PER_ENTRY = 1.75
"""Index slots per live entry at a rebuild; the index is rebuilt at 70 % full, so a
table takes 0.7 * 1.75 - 1 = 0.225 of its entries in new puts between two
rebuilds: ~3.5 B of index (2-byte slots, :func:`_index_of`) and ~11 % of array
slack per entry, 4.4 entries moved per put (a power-of-two index of 4-byte slots
at 2 slots per entry took 8-16 B and 20-50 %)."""
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

_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_MID = 1 << 31
"""A narrowed last use is ``last - base + _MID``: last uses within 2**31 either side
of the table's base."""
_AHEAD = 1 << 30
"""How far past the newest last use a moved window reaches (its base is then
``newest + _AHEAD - _MID``): it holds last uses up to 2**32 - _AHEAD = 3 * 2**30
events behind the newest, and moves again 2**30 events later (a table's entries
span its turnover of evictions: the events of ~its share of the pool's
evictions)."""
_DEAD = _U64
"""The low word of a dropped entry (its key's index value is kept: see ``_EMPTY``)."""
_WIDE = _U64 - 1
"""The low word of an entry whose ghost is kept whole (in ``_Shard._wide``). A
narrowed low word is neither: its field 0 is below 2**32 - 2 (:func:`_narrow`)."""
_SPARSE = 32
"""A table keeps its high words (field 2, the successor to revive) in a dict of the
few that are not 0 while they are at most one in ``_SPARSE`` of its entries, and in
a 32-bit array beside the others past that; a rebuild goes back to the dict when
they are one in ``2 * _SPARSE`` or fewer. A dict entry costs ~100 B, a word ~4.4 B
(the arrays' slack included): the dict is the cheaper while under ~1 in 23. Policies
set it only for a key evicted before its chain's tail, whose confirmed successor it
made a dead tail: none of the 382 343 evictions of ``adaptive`` on the suite's qa,
sharegpt, agent-fanout, docqa-mix and mooncake-conversation traces at 10 and 30 %
did (session 26)."""


def _narrow(ghost: int, base: int) -> tuple[int, int] | None:
    """A ghost's four 64-bit fields (bits 0, 64, 128, 192) as a 64-bit low word
    (fields 0 and 1, field 1 as its distance from ``base``) and a 32-bit high word
    (field 2), or None if one of them does not fit (field 0 at 2**32 - 2 or more:
    the low word's two marks, :data:`_DEAD` and :data:`_WIDE`) or field 3 is not 0."""
    f0, f2 = ghost & _U64, ghost >> 128 & _U64
    f1 = (ghost >> 64 & _U64) - base + _MID
    if f0 >= _U32 - 1 or f2 > _U32 or ghost >> 192 or not 0 <= f1 < _U32:
        return None
    return f0 | f1 << 32, f2


def _widen(lo: int, hi: int, base: int) -> int:
    return (lo & _U32) | ((lo >> 32) - _MID + base) << 64 | hi << 128


class GoneNames:
    """Name (a non-negative int below 2**63) -> ghost (a policy's ``take_ghost``: four
    unsigned 64-bit fields at bits 0, 64, 128 and 192), at most ``most`` of them
    (:meth:`put`), the oldest dropped first; an entry put again moves to the newest
    end. One table, so exactly that, until ``most`` first exceeds :data:`SPLIT_AT`;
    then :data:`SHARDS` tables, each holding its share of ``most`` (at least
    :data:`_SHARD_MIN`), so the oldest dropped is the oldest of its table, and each
    telling names apart by 32 bits (see the module's note)."""

    def __init__(self) -> None:
        self._shards: list[_Shard | None] = [None]
        self._bits = 0  # then _SHARD_BITS: a name's low bits pick its table
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def _key(self, name: int) -> int:
        return name >> self._bits & _U32 if self._bits else name

    def pop(self, name: int) -> int | None:
        """The ghost kept under ``name``, forgotten; None if there is none."""
        shard = self._shards[name & ((1 << self._bits) - 1)]
        if shard is None:
            return None
        ghost = shard.pop(self._key(name))
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
            shard = self._shards[i] = _Shard("I" if bits else "q")
        before = len(shard)
        shard.put(self._key(name), ghost)
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


def _index_of(cap: int) -> array[int]:
    """An empty index of ``cap`` slots: 2 bytes a slot while every array position
    fits them, as it does in a table of up to ~53 000 entries (10^8 gone names are
    ~25 000 a table): a table holds at most ``cap * 7 // 10`` entries between two
    rebuilds (:meth:`_Shard.put`), so no position placed exceeds that."""
    code = "H" if cap * 7 // 10 <= 0xFFFF else "I"
    return array(code, bytes(array(code).itemsize * cap))


class _Shard:
    """One table: keys (a GoneNames name's next 32 bits, or the name) -> ghosts,
    oldest first."""

    def __init__(self, typecode: str) -> None:
        self._names = array(typecode)
        """By age, oldest first from ``_head``."""
        self._lo = array("Q")
        self._hi: array[int] | None = None
        """The high words by array position, once they are too many for ``_his``."""
        self._his: dict[int, int] = {}  # key -> its live entry's high word, if not 0
        self._wide: dict[int, int] = {}  # key -> a ghost a field of which is too wide
        self._base = 0  # the last uses' reference (_narrow)
        self._head = 0
        self._live = 0
        self._used = 0  # index slots that are not _EMPTY (live and dropped entries)
        self._index = _index_of(_MIN_CAPACITY)
        self._cap = _MIN_CAPACITY

    def __len__(self) -> int:
        return self._live

    def _find(self, key: int) -> int:
        """The array position of ``key``'s live entry, or -1."""
        index, names, lo, cap = self._index, self._names, self._lo, self._cap
        i = key % cap
        while True:
            at = index[i]
            if at == _EMPTY:
                return -1
            at -= 1
            if names[at] == key and lo[at] != _DEAD:
                return at
            i += 1
            if i == cap:
                i = 0

    def _drop(self, at: int) -> None:
        """Forget the live entry at array position ``at``."""
        key = self._names[at]
        if self._lo[at] == _WIDE:
            del self._wide[key]
        elif self._hi is None:
            self._his.pop(key, None)
        self._lo[at] = _DEAD
        self._live -= 1

    def _ghost(self, at: int) -> int:
        lo, key = self._lo[at], self._names[at]
        if lo == _WIDE:
            return self._wide[key]
        hi = self._his.get(key, 0) if self._hi is None else self._hi[at]
        return _widen(lo, hi, self._base)

    def pop(self, key: int) -> int | None:
        at = self._find(key)
        if at < 0:
            return None
        ghost = self._ghost(at)
        self._drop(at)
        return ghost

    def put(self, key: int, ghost: int) -> None:
        at = self._find(key)
        if at >= 0:
            self._drop(at)
        last = ghost >> 64 & _U64
        # the clock ran past the window: move it (a last use of 2**63 or more is no
        # clock reading; it is kept whole rather than moving the window for it)
        if last - self._base + _MID >= _U32 and last < 1 << 63:
            self._rebuild(self._live + 1, base=last + _AHEAD - _MID)
        elif (
            self._used + 1 > self._cap * 7 // 10
            or len(self._names) >= 2 * self._live + _MIN_CAPACITY
        ):
            self._rebuild(self._live + 1)
        halves = _narrow(ghost, self._base)
        if halves is None:
            self._wide[key] = ghost
            halves = (_WIDE, 0)
        self._names.append(key)
        self._lo.append(halves[0])
        self._live += 1
        if self._hi is not None:
            self._hi.append(halves[1])
        elif halves[1]:
            self._his[key] = halves[1]
            if len(self._his) * _SPARSE > self._live + _SPARSE * _SHARD_MIN:
                self._densify()
        self._place(key, len(self._names))

    def _densify(self) -> None:
        """The high words from ``_his`` into an array by position (0 at dropped and
        whole entries, whose high word is never read)."""
        his, lo = self._his, self._lo
        self._hi = array(
            "I",
            (
                his.get(key, 0) if low != _DEAD and low != _WIDE else 0
                for key, low in zip(self._names, lo, strict=True)
            ),
        )
        self._his = {}

    def _place(self, key: int, at: int) -> None:
        index, cap = self._index, self._cap
        i = key % cap
        while index[i] != _EMPTY:
            i += 1
            if i == cap:
                i = 0
        index[i] = at
        self._used += 1

    def trim(self, most: int) -> None:
        """Drop the oldest entries until at most ``most`` are left."""
        lo = self._lo
        while self._live > most:
            head = self._head
            if lo[head] != _DEAD:
                self._drop(head)
            self._head = head + 1

    def _rebuild(self, live: int, base: int | None = None) -> None:
        """The live entries, oldest first, in fresh arrays (their last uses measured
        from ``base`` if given: one that falls outside is kept whole); an index
        sized for ``live``. High words in an array go back to the dict when few
        are not 0 (:data:`_SPARSE`)."""
        names, lo, hi, head = self._names, self._lo, self._hi, self._head
        no_holes = len(names) - head == self._live  # no dropped entry past the head: slices
        keep = (
            range(head, len(names))
            if no_holes
            else [i for i in range(head, len(names)) if lo[i] != _DEAD]
        )
        new_lo = lo[head:] if no_holes else array("Q", (lo[i] for i in keep))
        if base is not None and base != self._base:
            shift = self._base - base
            for j, i in enumerate(keep):
                low = new_lo[j]
                if low == _WIDE:
                    continue
                f1 = (low >> 32) + shift
                if 0 <= f1 < _U32:
                    new_lo[j] = (low & _U32) | f1 << 32
                else:
                    key = names[i]
                    high = self._his.pop(key, 0) if hi is None else hi[i]
                    self._wide[key] = _widen(low, high, self._base)
                    new_lo[j] = _WIDE
            self._base = base
        if no_holes:
            self._names = names[head:]
            if hi is not None:
                self._hi = hi[head:]
        else:
            self._names = array(names.typecode, (names[i] for i in keep))
            if hi is not None:
                self._hi = array("I", (hi[i] for i in keep))
        self._lo = new_lo
        hi = self._hi
        if hi is not None and (len(hi) - hi.count(0)) * 2 * _SPARSE <= len(hi):
            self._his = {
                key: high
                for key, low, high in zip(self._names, new_lo, hi, strict=True)
                if high and low != _WIDE
            }
            self._hi = None
        self._head = 0
        self._cap = cap = max(_MIN_CAPACITY, int(live * _SLOTS_PER_ENTRY) + 1)
        self._index = index = _index_of(cap)
        for at, key in enumerate(self._names, 1):  # _place, inline: most of a rebuild
            i = key % cap
            while index[i] != _EMPTY:
                i += 1
                if i == cap:
                    i = 0
            index[i] = at
        self._used = len(self._names)

    def items(self) -> Iterator[tuple[int, int]]:
        """(key, ghost), oldest first."""
        lo = self._lo
        for at in range(self._head, len(self._names)):
            if lo[at] != _DEAD:
                yield self._names[at], self._ghost(at)
