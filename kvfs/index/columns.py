"""Copy-on-write storage for the namespace: chunked columns, a byte arena, a name index.

Every structure is a list of fixed-size chunks. :meth:`freeze` marks every chunk shared
and returns references to them in O(chunks); the next write to a shared chunk copies
that chunk first (a C-level slice), so a frozen image stays the point-in-time state
while the namespace goes on changing. Pure and synchronous.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import xxhash

from kvfs.format.nsparts import ARENA_CHUNK, GRANULE, LADDERS, ROWS, SHIFT

MASK = ROWS - 1
ARENA_MAX_ENTRY = 4096
"""Larger values (big xattr sets) live in a side table instead."""


def narrowed(values: array[int], ladder: str) -> array[int]:
    """``values`` in the narrowest code of ``ladder`` that holds them (``values``
    itself if that is its own code): each code is tried by converting, which stops
    at the first item out of range; OverflowError when none holds them."""
    for code in ladder:
        if code == values.typecode:
            return values
        try:
            return array(code, values)
        except OverflowError:
            continue
    raise OverflowError(f"a value past a {ladder[-1]!r} column")


def fit(chunk: array[int], ladder: str, values: array[int]) -> tuple[array[int], array[int]]:
    """(``chunk`` in the narrowest code of ``ladder`` from its own up that also holds
    ``values``, ``values`` in that code); ``chunk`` itself when its code does. The
    chunk's items fit every wider code of its ladder, so only ``values`` decide."""
    fitted = narrowed(values, ladder[ladder.index(chunk.typecode) :])
    code = fitted.typecode
    return (chunk if code == chunk.typecode else array(code, chunk)), fitted


class Column:
    """An integer column indexed by row (inode number), zero where never written.

    A *narrowing* column (``narrow=True``) keeps each chunk in the narrowest item
    code its values fit (``kvfs.format.nsparts.LADDERS``: a column of link counts is
    one byte per row until a count passes 255): a store that does not fit widens that one chunk
    (``OverflowError`` from the array, caught), exact values always. Chunks never
    written are one shared zero chunk (copy-on-write like a frozen one). Readers
    index chunks as before; only C-level byte tricks need a fixed code, and the
    columns they read are not narrowing."""

    __slots__ = ("chunks", "code", "ladder", "shared", "zero")

    def __init__(self, code: str, narrow: bool = False) -> None:
        self.code = code
        self.ladder = LADDERS[code] if narrow else code
        self.chunks: list[array[int]] = []
        self.shared = bytearray()
        self.zero = array(self.ladder[0], bytes(ROWS * array(self.ladder[0]).itemsize))

    def __getitem__(self, i: int) -> int:
        return self.chunks[i >> SHIFT][i & MASK]

    def __setitem__(self, i: int, value: int) -> None:
        c = i >> SHIFT
        if self.shared[c]:
            if not value and self.chunks[c] is self.zero:
                return  # a zero into a chunk never written: nothing to copy
            self.chunks[c] = self.chunks[c][:]
            self.shared[c] = 0
        try:
            self.chunks[c][i & MASK] = value
        except OverflowError:
            self._fit(c, array("q" if value < 1 << 63 else "Q", [value]))[0][i & MASK] = value

    def _fit(self, c: int, values: array[int]) -> tuple[array[int], array[int]]:
        """(chunk ``c``, not shared, widened to hold ``values`` too; ``values`` in
        its code): :func:`fit`."""
        chunk, fitted = fit(self.chunks[c], self.ladder, values)
        self.chunks[c] = chunk
        return chunk, fitted

    def ensure(self, rows: int) -> None:
        """Room for rows ``0 .. rows-1``."""
        while len(self.chunks) << SHIFT < rows:
            self.chunks.append(self.zero)
            self.shared.append(1)

    def writable_chunk(self, c: int) -> array[int]:
        """Chunk ``c`` for bulk writes (copied first if shared)."""
        if self.shared[c]:
            self.chunks[c] = self.chunks[c][:]
            self.shared[c] = 0
        return self.chunks[c]

    def fill(self, start: int, values: array[int]) -> None:
        """Rows ``start ..`` = ``values`` (C-level slice copies per chunk)."""
        done = 0
        while done < len(values):
            i = start + done
            c, pos = i >> SHIFT, i & MASK
            n = min(ROWS - pos, len(values) - done)
            chunk, piece = self.writable_chunk(c), values[done : done + n]
            if piece.typecode != chunk.typecode:
                chunk, piece = self._fit(c, piece)
            chunk[pos : pos + n] = piece
            done += n

    def freeze(self) -> list[array[int]]:
        self.shared[:] = b"\1" * len(self.chunks)
        return list(self.chunks)

    def install(self, c: int, chunk: array[int]) -> None:
        """Chunk ``c`` = ``chunk`` (``ROWS`` items of a code of this column's ladder,
        decoded from an image; kept as it is: a caller that filled it at the declared
        code calls :meth:`narrow`)."""
        if chunk.typecode not in self.ladder:
            raise ValueError(f"column chunk of code {chunk.typecode!r} in a {self.code!r} column")
        if len(chunk) != ROWS:
            raise ValueError(f"column chunk of {len(chunk)} rows")
        self.ensure((c + 1) << SHIFT)
        self.chunks[c] = chunk
        self.shared[c] = 0

    def narrow(self, c: int) -> None:
        """Chunk ``c`` in the narrowest code its values fit (after a bulk write)."""
        if len(self.ladder) > 1:
            self.chunks[c] = narrowed(self.chunks[c], self.ladder)

    def nbytes(self) -> int:
        return sum(len(c) * c.itemsize for c in self.chunks if c is not self.zero)


class Arena:
    """Variable-length byte strings (names, serialized xattrs) at granule offsets.
    Freed space is reused by entries of the same granule count (file names of one
    engine have one length, so churn does not grow the arena)."""

    __slots__ = ("chunks", "free", "shared", "tail")

    def __init__(self) -> None:
        self.chunks: list[bytearray] = []
        self.shared = bytearray()
        self.tail = 0
        """Granule offset of the first never-used granule."""
        self.free: dict[int, array[int]] = {}

    def put(self, data: bytes) -> int:
        """Store ``data`` (1..ARENA_MAX_ENTRY bytes); returns its granule offset."""
        g = -(-len(data) // GRANULE)
        slots = self.free.get(g)
        if slots:
            off = slots.pop()
        else:
            per_chunk = ARENA_CHUNK // GRANULE
            if (self.tail % per_chunk) + g > per_chunk:
                self.tail += per_chunk - self.tail % per_chunk
            off = self.tail
            self.tail += g
        c, pos = divmod(off * GRANULE, ARENA_CHUNK)
        while len(self.chunks) <= c:
            self.chunks.append(bytearray(ARENA_CHUNK))
            self.shared.append(0)
        if self.shared[c]:
            self.chunks[c] = self.chunks[c][:]
            self.shared[c] = 0
        self.chunks[c][pos : pos + len(data)] = data
        return off

    def get(self, off: int, length: int) -> bytes:
        c, pos = divmod(off * GRANULE, ARENA_CHUNK)
        return bytes(self.chunks[c][pos : pos + length])

    def equals(self, off: int, length: int, data: bytes) -> bool:
        c, pos = divmod(off * GRANULE, ARENA_CHUNK)
        return self.chunks[c][pos : pos + length] == data

    def release(self, off: int, length: int) -> None:
        """Free an entry; its bytes are zeroed, so an emptied chunk checkpoints as
        nothing."""
        g = -(-length // GRANULE)
        c, pos = divmod(off * GRANULE, ARENA_CHUNK)
        if self.shared[c]:
            self.chunks[c] = self.chunks[c][:]
            self.shared[c] = 0
        self.chunks[c][pos : pos + g * GRANULE] = bytes(g * GRANULE)
        slots = self.free.get(g)
        if slots is None:
            slots = self.free[g] = array("I")
        slots.append(off)

    def freeze(self) -> list[bytearray]:
        self.shared[:] = b"\1" * len(self.chunks)
        return list(self.chunks)

    def load_chunk(self, c: int, raw: bytes) -> None:
        if len(raw) != ARENA_CHUNK:
            raise ValueError(f"arena chunk of {len(raw)} bytes")
        while len(self.chunks) <= c:
            self.chunks.append(bytearray(ARENA_CHUNK))
            self.shared.append(0)
        self.chunks[c] = bytearray(raw)
        self.shared[c] = 0

    def nbytes(self) -> int:
        return len(self.chunks) * ARENA_CHUNK + sum(len(s) * 4 for s in self.free.values())


EMPTY = 0
TOMB = 0xFFFFFFFF
"""A deleted slot: only in a table loaded from a version-1 namespace image (deletion
is by backward shift since), which becomes the old table of a migration."""

MIGRATE_STEP = 128
"""Slots of the old table a migration sweeps per insert or remove (then on to the
end of the cluster it is in). A grow leaves 3/4 of the old size in inserts before
the new table is 75% full, a shrink 1/16: any step of 16 or more finishes the
migration first, so no operation waits for more than one step."""


def name_hash(parent: int, name: bytes) -> int:
    return xxhash.xxh3_64_intdigest(name, parent)


def table_size(names: int) -> int:
    """The smallest table (a power of two, at least ROWS) that ``names`` fill at
    most 60%."""
    size = ROWS
    while size * 3 < names * 5:
        size *= 2
    return size


class Table:
    """One open-addressing table: a chunked 'I' column of inode numbers."""

    __slots__ = ("mask", "slots", "tombs", "used", "zero")

    def __init__(self, size: int) -> None:
        # every chunk starts as one shared zero chunk, copied by its first write:
        # a new table of 2^24 slots costs list entries, not 16k allocations at once
        n = max(1, size >> SHIFT)
        self.zero = array("I", bytes(ROWS * 4))
        self.slots = Column("I")
        self.slots.chunks = [self.zero] * n
        self.slots.shared = bytearray(b"\1" * n)
        self.mask = size - 1
        self.used = 0
        self.tombs = 0

    @property
    def size(self) -> int:
        return self.mask + 1


class NameIndex:
    """(parent, name) -> inode: open addressing with linear probing over chunked 'I'
    columns of inode numbers (0 empty). Names are not stored here:
    ``matches(ino, parent, name)`` compares them where they live, ``key_of(ino)``
    gives them back to rehash.

    Deletion shifts the rest of the cluster back (no tombstones). Growth (past 75%)
    and shrinking (under 1/8, to at most 60%) are incremental: ``table`` is the new
    table, ``old`` the one being emptied into it in slot order, slots
    ``0 .. cursor-1`` done, at least MIGRATE_STEP slots per insert or remove, a step
    ending only at an empty slot. So what is cleared is whole clusters, plus the
    part of a cluster wrapping past the end that lies from slot 0 on: no name left
    in ``old`` probes through a cleared slot, ``old`` stays a valid table of the
    names not yet moved, and as nothing is inserted into it, every name is in
    exactly one of the two. Lookups try both until the cursor reaches the end."""

    __slots__ = ("_key_of", "_matches", "_parts", "cursor", "old", "table")

    def __init__(
        self,
        matches: Callable[[int, int, bytes], bool],
        key_of: Callable[[int], tuple[int, bytes]],
        size: int = ROWS,
    ) -> None:
        self._matches = matches
        self._key_of = key_of
        self.table = Table(size)
        self.old: Table | None = None
        self.cursor = 0
        self._parts: tuple[Table, ...] = ()

    @property
    def used(self) -> int:
        return self.table.used + (self.old.used if self.old is not None else 0)

    def find(self, parent: int, name: bytes) -> int:
        """The inode named ``name`` in ``parent``, 0 if none."""
        h = name_hash(parent, name)
        ino = self._probe(self.table, h, parent, name)
        if ino or self.old is None:
            return ino
        return self._probe(self.old, h, parent, name)

    def _probe(self, t: Table, h: int, parent: int, name: bytes) -> int:
        mask, slots, matches = t.mask, t.slots, self._matches
        h &= mask
        while True:
            ino = slots[h]
            if ino == EMPTY:
                return 0
            if ino != TOMB and matches(ino, parent, name):
                return ino
            h = (h + 1) & mask

    def insert(self, parent: int, name: bytes, ino: int) -> None:
        """Add a name known to be absent."""
        if self.old is not None:
            self._migrate(MIGRATE_STEP)
        t = self.table
        if (self.used + 1) * 4 > t.size * 3:
            if self.old is not None:  # not with MIGRATE_STEP >= 16 (see there)
                self._migrate(self.old.size)
            self._begin(table_size(self.used + 1))
        _place(self.table, name_hash(parent, name), ino)

    def remove(self, parent: int, name: bytes, ino: int) -> None:
        h = name_hash(parent, name)
        if not self._unplace(self.table, h, ino) and (
            self.old is None or not self._unplace(self.old, h, ino)
        ):
            raise KeyError((parent, name))
        if self.old is not None:
            self._migrate(MIGRATE_STEP)
        elif self.table.size > ROWS and self.table.used * 8 < self.table.size:
            self._begin(table_size(self.table.used))

    def _unplace(self, t: Table, h: int, ino: int) -> bool:
        """Delete ``ino`` from ``t`` (probing from hash ``h``); False if absent."""
        mask, slots = t.mask, t.slots
        i = h & mask
        while True:
            cur = slots[i]
            if cur == EMPTY:
                return False
            if cur == ino:
                break
            i = (i + 1) & mask
        t.used -= 1
        if t.tombs:  # a version-1 table, being migrated: keep its probe chains
            slots[i] = TOMB
            t.tombs += 1
            return True
        # backward shift: move each later name of the cluster that may live at i
        # (its home is not in (i, j]) into the hole, until an empty slot
        key_of, j = self._key_of, i
        while True:
            j = (j + 1) & mask
            cur = slots[j]
            if cur == EMPTY:
                break
            home = name_hash(*key_of(cur)) & mask
            if (j - home) & mask >= (j - i) & mask:
                slots[i] = cur
                i = j
        slots[i] = EMPTY
        return True

    def _begin(self, size: int) -> None:
        """Start moving every name into a new table of ``size`` slots."""
        old = self.table
        self.table = Table(size)
        if old.used:
            self.old, self.cursor = old, 0

    def _migrate(self, budget: int) -> None:
        """Move the names of at least ``budget`` old slots, stopping at an empty one."""
        old = self.old
        assert old is not None
        slots, size, t, key_of = old.slots, old.size, self.table, self._key_of
        c = self.cursor
        end = c + budget
        while c < size:
            ino = slots[c]
            if ino == EMPTY:
                if c >= end:
                    break
            else:
                slots[c] = EMPTY
                if ino != TOMB:
                    _place(t, name_hash(*key_of(ino)), ino)
                    old.used -= 1
            c += 1
        for k in range(self.cursor >> SHIFT, c >> SHIFT):  # swept: free them now,
            slots.chunks[k] = old.zero  # not 16k chunks at once at the end
            slots.shared[k] = 1
        self.cursor = c
        if c == size:
            self.old, self.cursor = None, 0

    def freeze(self) -> tuple[list[array[int]], list[array[int]]]:
        """Copy-on-write snapshots of the table and the old table ([] if none)."""
        return self.table.slots.freeze(), self.old.slots.freeze() if self.old else []

    def load(
        self, size: int, used: int, old_size: int = 0, old_used: int = 0, cursor: int = 0
    ) -> None:
        """Set the geometry of the tables whose chunks are loaded next
        (:meth:`part_table`); ``old_size`` 0: no migration."""
        self.table = Table(size)
        self.table.used = used
        self.old, self.cursor = None, 0
        self._parts = (self.table,)
        if old_size:
            self.old = Table(old_size)
            self.old.used = old_used
            self.cursor = cursor
            self._parts = (self.table, self.old)

    def load_legacy(self, size: int, used: int, tombs: int) -> None:
        """A version-1 image's single table, which may hold deleted slots: with
        none it is the table; else the old table of a migration into a new one
        (deleted slots count as taken until it is emptied)."""
        if not tombs:
            self.load(size, used)
            return
        self.load(table_size(used + 1), 0, size, used, 0)
        assert self.old is not None
        self.old.tombs = tombs
        self._parts = (self.old,)

    def part_table(self, pid: int) -> Table:
        """The table that image part ``pid`` loads into (after :meth:`load`: 0 the
        table, 1 the old one)."""
        if pid >= len(self._parts):
            raise ValueError(f"name index part {pid} without its table")
        return self._parts[pid]

    def nbytes(self) -> int:
        return self.table.slots.nbytes() + (self.old.slots.nbytes() if self.old else 0)


def _place(t: Table, h: int, ino: int) -> None:
    """Put ``ino`` into the first empty slot from hash ``h`` (``t`` has no
    deleted slots)."""
    mask, slots = t.mask, t.slots
    h &= mask
    while slots[h] != EMPTY:
        h = (h + 1) & mask
    slots[h] = ino
    t.used += 1


__all__ = [
    "ARENA_CHUNK",
    "ARENA_MAX_ENTRY",
    "GRANULE",
    "MASK",
    "MIGRATE_STEP",
    "ROWS",
    "SHIFT",
    "TOMB",
    "Arena",
    "Column",
    "NameIndex",
    "Table",
    "fit",
    "name_hash",
    "narrowed",
    "table_size",
]
