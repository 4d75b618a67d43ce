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

SHIFT = 10
ROWS = 1 << SHIFT
"""Rows per column chunk (8 KiB for an 8-byte column): the unit of copy-on-write,
and small enough that a nearly empty namespace checkpoints in a few KiB."""
MASK = ROWS - 1

GRANULE = 4
"""Arena allocation unit in bytes: offsets are granule numbers in an 'I' column."""
ARENA_CHUNK = 64 << 10
"""Arena chunk size in bytes; no entry spans two chunks."""
ARENA_MAX_ENTRY = 4096
"""Larger values (big xattr sets) live in a side table instead."""


class Column:
    """An integer column indexed by row (inode number), zero where never written."""

    __slots__ = ("chunks", "code", "shared")

    def __init__(self, code: str) -> None:
        self.code = code
        self.chunks: list[array[int]] = []
        self.shared = bytearray()

    def __getitem__(self, i: int) -> int:
        return self.chunks[i >> SHIFT][i & MASK]

    def __setitem__(self, i: int, value: int) -> None:
        c = i >> SHIFT
        if self.shared[c]:
            self.chunks[c] = self.chunks[c][:]
            self.shared[c] = 0
        self.chunks[c][i & MASK] = value

    def ensure(self, rows: int) -> None:
        """Room for rows ``0 .. rows-1``."""
        while len(self.chunks) << SHIFT < rows:
            self.chunks.append(array(self.code, bytes(ROWS * array(self.code).itemsize)))
            self.shared.append(0)

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
            self.writable_chunk(c)[pos : pos + n] = values[done : done + n]
            done += n

    def freeze(self) -> list[array[int]]:
        self.shared[:] = b"\1" * len(self.chunks)
        return list(self.chunks)

    def load_chunk(self, c: int, raw: bytes) -> None:
        chunk = array(self.code)
        chunk.frombytes(raw)
        if len(chunk) != ROWS:
            raise ValueError(f"column chunk of {len(chunk)} rows")
        self.ensure((c + 1) << SHIFT)
        self.chunks[c] = chunk
        self.shared[c] = 0

    def nbytes(self) -> int:
        return sum(len(c) * c.itemsize for c in self.chunks)


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


def name_hash(parent: int, name: bytes) -> int:
    return xxhash.xxh3_64_intdigest(name, parent)


class NameIndex:
    """(parent, name) -> inode: open addressing with linear probing over a chunked
    'I' column of inode numbers (0 empty, 2^32-1 deleted). Names are not stored
    here: ``matches(ino, parent, name)`` compares them where they live."""

    __slots__ = ("_key_of", "_matches", "mask", "slots", "tombs", "used")

    def __init__(
        self,
        matches: Callable[[int, int, bytes], bool],
        key_of: Callable[[int], tuple[int, bytes]],
        size: int = ROWS,
    ) -> None:
        self._matches = matches
        self._key_of = key_of
        self.slots = Column("I")
        self.slots.ensure(size)
        self.mask = size - 1
        self.used = 0
        self.tombs = 0

    def find(self, parent: int, name: bytes) -> int:
        """The inode named ``name`` in ``parent``, 0 if none."""
        mask, slots, matches = self.mask, self.slots, self._matches
        h = name_hash(parent, name) & mask
        while True:
            ino = slots[h]
            if ino == EMPTY:
                return 0
            if ino != TOMB and matches(ino, parent, name):
                return ino
            h = (h + 1) & mask

    def insert(self, parent: int, name: bytes, ino: int) -> None:
        """Add a name known to be absent."""
        if (self.used + self.tombs + 1) * 4 > (self.mask + 1) * 3:
            self._resize()
        mask, slots = self.mask, self.slots
        h = name_hash(parent, name) & mask
        while True:
            cur = slots[h]
            if cur in (EMPTY, TOMB):
                self.tombs -= cur == TOMB
                slots[h] = ino
                self.used += 1
                return
            h = (h + 1) & mask

    def remove(self, parent: int, name: bytes, ino: int) -> None:
        mask, slots = self.mask, self.slots
        h = name_hash(parent, name) & mask
        while True:
            cur = slots[h]
            if cur == EMPTY:
                raise KeyError((parent, name))
            if cur == ino:
                slots[h] = TOMB
                self.used -= 1
                self.tombs += 1
                return
            h = (h + 1) & mask

    def _resize(self) -> None:
        """Rehash into the smallest table the names fill at most 60% (grown again
        at 75%: linear probing stays short; 4 B / 0.6 = 6.7 B per name). A Python
        loop over every name: ~1.5 us each, so rare by doubling."""
        size = ROWS
        while size * 3 < (self.used + 1) * 5:
            size *= 2
        old = [ino for chunk in self.slots.chunks for ino in chunk if ino not in (EMPTY, TOMB)]
        self.slots = Column("I")
        self.slots.ensure(size)
        self.mask, self.used, self.tombs = size - 1, 0, 0
        for ino in old:
            parent, name = self._key_of(ino)
            self.insert(parent, name, ino)

    def freeze(self) -> list[array[int]]:
        return self.slots.freeze()

    def load(self, size: int, used: int, tombs: int) -> None:
        """Set the geometry of a table whose chunks are loaded next."""
        self.slots = Column("I")
        self.slots.ensure(size)
        self.mask, self.used, self.tombs = size - 1, used, tombs
