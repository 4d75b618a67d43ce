"""The slot table shared by the policies: per-key state as chunked typed columns.

No per-key Python objects: a key below :data:`DIRECT` (an inode number: the
namespace hands them out densely) *is* its slot (``key + lists``), so a file costs
only its entries in the typed columns -- no dict entry, no int object.  Other keys
(64-bit hashes in the simulators) get a slot from a dict, in a region above the
direct one.  The lists a policy keeps (LRU order, probation, main, ghosts, ...) are
intrusive circular doubly linked lists threaded through the ``prev``/``next``
columns, so moving a key between lists is O(1) and allocates nothing.

Columns are :class:`SlotColumn`: chunks of :data:`ROWS` rows allocated when first
written, copy-on-write after :meth:`SlotColumn.freeze` (a checkpoint takes the
state in O(chunks) and encodes it off the event loop), and *widening*: a column
starts at the narrowest typecode its policy names (``i``/``I``: 4 bytes) and turns
into int64 the first time a value does not fit (a sparse key, a clock past 2**32),
so values are exactly what a dict of ints would hold.  Pure and synchronous.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from itertools import compress

from kvfs.format.policy_image import (
    DIRECT,
    FREE,
    LADDERS,
    LEGACY_DIRECT,
    LINK,
    MASK,
    NO_KEY,
    ROWS,
    SHIFT,
    TableImage,
)
from kvfs.index.columns import fit, narrowed

__all__ = [
    "DIRECT",
    "FREE",
    "LEGACY_DIRECT",
    "LOOSE",
    "MASK",
    "NO_KEY",
    "ROWS",
    "SHIFT",
    "SlotColumn",
    "SlotTable",
    "runs",
]

LOOSE = -2
"""Owner of a slot that holds a key but is in no list (between two list moves; never
in an image)."""


def runs(keys: array[int]) -> list[tuple[int, int]]:
    """(i, j) of each maximal run ``keys[i:j]`` of consecutive numbers, in order.
    Galloping C-level slice comparisons with ``range`` arrays: O(run length) at C
    speed plus O(log) Python steps per run (a namespace's files are long runs of
    inode numbers)."""
    n = len(keys)
    out: list[tuple[int, int]] = []
    code = keys.typecode
    i = 0
    while i < n:
        first = keys[i]
        if i + 1 == n or keys[i + 1] != first + 1:
            out.append((i, i + 1))
            i += 1
            continue
        good, step = 2, 4  # keys[i : i + good] is a run
        while i + good < n:
            k = min(step, n - i)
            expected = array(code, range(first + good, first + k))
            if keys[i + good : i + k] != expected:
                break
            good, step = k, 2 * k
        else:
            out.append((i, n))
            break
        # keys[i : i + k] is not a run: bisect the boundary, comparing with slices
        # of ``expected`` (rows good0 .. k of the run it would be)
        good0, bad = good, k
        while bad - good > 1:
            mid = (good + bad) // 2
            if keys[i + good : i + mid] == expected[good - good0 : mid - good0]:
                good = mid
            else:
                bad = mid
        out.append((i, i + good))
        i += good
    return out


def _pieces(
    spans: list[tuple[int, int]], keys: array[int], offset: int
) -> Iterator[tuple[int, int]]:
    """The runs ``spans`` of consecutive ``keys`` cut where ``key + offset`` enters
    another chunk."""
    for i, j in spans:
        while i < j:
            k = min(j - i, ROWS - ((keys[i] + offset) & MASK))
            yield i, i + k
            i += k


class SlotColumn:
    """An integer column indexed by slot: chunks allocated on first write (filled
    with ``fill``), shared after :meth:`freeze` until written, widened to int64 on
    the first value that does not fit.

    A *narrowing* column (``narrow=True``: the policies' own fields) keeps each
    chunk in the narrowest code of its ladder (``LADDERS``) that holds its values
    and widens only that chunk when a store does not fit; ``code`` stays the
    nominal code the policy names (the image's head)."""

    __slots__ = ("chunks", "code", "fill", "ladder", "shared")

    def __init__(self, code: str, fill: int = 0, narrow: bool = False) -> None:
        self.code = code
        self.fill = fill
        self.ladder = LADDERS[code] if narrow else ""
        self.chunks: list[array[int] | None] = []
        self.shared = bytearray()

    def __getitem__(self, i: int) -> int:
        return self.chunks[i >> SHIFT][i & MASK]  # type: ignore[index]

    def get(self, i: int, default: int) -> int:
        """Row ``i``, or ``default`` where no chunk holds it."""
        c = i >> SHIFT
        if c >= len(self.chunks):
            return default
        chunk = self.chunks[c]
        return default if chunk is None else chunk[i & MASK]

    def __setitem__(self, i: int, value: int) -> None:
        c = i >> SHIFT
        if self.shared[c]:
            self._own(c)
        try:
            self.chunks[c][i & MASK] = value  # type: ignore[index]
        except OverflowError:
            self._holding(c, array("q", [value]))[0][i & MASK] = value

    def _holding(self, c: int, values: array[int]) -> tuple[array[int], array[int]]:
        """(chunk ``c`` (existing), owned and able to hold ``values``; ``values`` in
        its code): a narrowing column widens that chunk (``columns.fit``), another
        column widens itself to int64 if the values do not fit its code."""
        chunk = self.writable(c)
        if values.typecode == chunk.typecode:
            return chunk, values
        if self.ladder:
            chunk, values = fit(chunk, self.ladder, values)
            self.chunks[c] = chunk
            return chunk, values
        try:
            return chunk, array(chunk.typecode, values)
        except OverflowError:
            self.widen()
            chunk = self.writable(c)
            return chunk, array(chunk.typecode, values)

    def assign(self, c: int, pos: int, values: array[int]) -> None:
        """Rows ``pos ..`` of chunk ``c`` (existing) = ``values`` (any int code)."""
        chunk, values = self._holding(c, values)
        chunk[pos : pos + len(values)] = values

    def assign_constant(self, c: int, pos: int, k: int, value: int) -> None:
        """Rows ``pos .. pos + k - 1`` of chunk ``c`` (existing) = ``value`` (one
        conversion, then a C-level repeat)."""
        chunk, one = self._holding(c, array("q", [value]))
        chunk[pos : pos + k] = one * k

    def _own(self, c: int) -> None:
        chunk = self.chunks[c]
        self.chunks[c] = None if chunk is None else chunk[:]
        self.shared[c] = 0

    def ensure(self, rows: int) -> None:
        """Chunks exist (allocated) for rows ``0 .. rows-1``."""
        last = (rows - 1) >> SHIFT
        while len(self.chunks) <= last:
            self.chunks.append(None)
            self.shared.append(0)
        for c in range(last + 1):
            if self.chunks[c] is None:
                self.allocate(c)

    def ensure_row(self, i: int) -> None:
        """The chunk of row ``i`` exists."""
        c = i >> SHIFT
        if c >= len(self.chunks):
            self.chunks.extend([None] * (c + 1 - len(self.chunks)))
            self.shared.extend(bytes(c + 1 - len(self.shared)))
        if self.chunks[c] is None:
            self.allocate(c)

    def allocate(self, c: int) -> None:
        self.chunks[c] = array(self.ladder[0] if self.ladder else self.code, [self.fill]) * ROWS
        self.shared[c] = 0

    def writable(self, c: int) -> array[int]:
        """Chunk ``c`` (existing) for direct writes, copied first if shared."""
        if self.shared[c]:
            self._own(c)
        return self.chunks[c]  # type: ignore[return-value]

    def widen(self) -> None:
        """Make every chunk int64 (a value did not fit)."""
        self.code = "q"
        self.chunks = [None if ch is None else array("q", ch) for ch in self.chunks]
        self.shared = bytearray(len(self.chunks))

    def freeze(self) -> list[array[int] | None]:
        """The chunks as they are now; later writes copy a chunk before changing it."""
        self.shared = bytearray(b"\1") * len(self.chunks)
        return list(self.chunks)

    def load(self, c: int, chunk: array[int], narrow: bool = False) -> None:
        """Install a decoded chunk (widening the column or the chunk to agree; a
        narrowing column keeps a chunk of its ladder as it is, and with ``narrow``
        makes it as narrow as its values allow)."""
        if self.ladder and chunk.typecode in self.ladder:
            pass
        elif chunk.typecode != self.code:
            if chunk.typecode == "q":
                self.widen()
            else:
                chunk = array(self.code, chunk)
        if c >= len(self.chunks):
            self.chunks.extend([None] * (c + 1 - len(self.chunks)))
            self.shared.extend(bytes(c + 1 - len(self.shared)))
        self.chunks[c] = chunk
        self.shared[c] = 0
        if narrow and self.ladder:
            self.chunks[c] = narrowed(chunk, self.ladder)

    def nbytes(self) -> int:
        return sum(len(ch) * ch.itemsize for ch in self.chunks if ch is not None)


class SlotTable:
    """Per-key state as chunked columns indexed by slot, plus intrusive circular lists.

    Slots ``0 .. lists-1`` are the lists' sentinels; key ``k < DIRECT`` has slot
    ``k + lists``; other keys are mapped by ``index`` to slots from ``sparse_base``
    up (freed ones reused).  ``owner`` is the list a slot is in, :data:`LOOSE` for
    a key in no list and :data:`FREE` for no key.  A slot is in at most one list.
    ``columns`` are the policy's own per-key fields (typecodes it names), 0 for a
    new key.
    """

    def __init__(self, lists: int, columns: tuple[str, ...]) -> None:
        self.lists = lists
        self.direct = DIRECT
        """Keys below this are their own slot (``key + lists``); DIRECT or 0."""
        self.decided = False
        self.sparse_base = DIRECT + lists
        self.index: dict[int, int] = {}
        self.sparse_keys = array("q")  # key of slot sparse_base + i (NO_KEY: free)
        self.sparse_free = array("q")
        self.prev = SlotColumn(LINK)
        self.next = SlotColumn(LINK)
        self.owner = SlotColumn("b", FREE)
        self.columns = [SlotColumn(code, narrow=True) for code in columns]
        self.count = [0] * lists
        for column in self.all_columns():
            column.ensure_row(0)
        for lst in range(lists):
            self.prev[lst] = self.next[lst] = self.owner[lst] = lst

    def image(self, persisted: int, scalars: list[int]) -> TableImage:
        """Freeze the table now (O(chunks): later writes copy a chunk first) and
        return what its image holds: the first ``persisted`` lists are the resident
        ones, ``scalars`` the policy's."""
        columns = self.all_columns()
        return TableImage(
            lists=self.lists,
            persisted=persisted,
            codes="".join(column.code for column in columns),
            columns=[column.freeze() for column in columns],
            counts=list(self.count),
            scalars=scalars,
            sparse_keys=self.sparse_keys,
            sparse_free=self.sparse_free,
            direct=self.direct,
            decided=self.decided,
        )

    @classmethod
    def from_image(cls, image: TableImage) -> SlotTable:
        """A table holding a decoded (validated) image; a version 2 image's chunks
        are made as narrow as their values allow."""
        table = cls(image.lists, tuple(image.codes[3:]))
        table.direct, table.decided = image.direct, image.decided
        table.sparse_base = image.direct + image.lists
        columns = table.all_columns()
        for column, chunks in zip(columns, image.columns, strict=True):
            for c, chunk in enumerate(chunks):
                if chunk is not None:
                    column.load(c, chunk, narrow=not image.own_codes)
        table.sparse_keys = image.sparse_keys
        table.sparse_free = image.sparse_free
        base = table.sparse_base
        table.index = {key: base + i for i, key in enumerate(image.sparse_keys) if key != NO_KEY}
        table.count[:] = image.counts
        return table

    def all_columns(self) -> list[SlotColumn]:
        """Every column in persisted order: prev, next, owner, then the policy's."""
        return [self.prev, self.next, self.owner, *self.columns]

    # -- keys and slots ------------------------------------------------------------------

    def find(self, key: int) -> int | None:
        """Return the slot holding ``key`` (in a list or loose), or None."""
        if 0 <= key < self.direct:
            slot = key + self.lists
            chunks = self.owner.chunks  # (inlined SlotColumn.get: the hottest path)
            c = slot >> SHIFT
            if c < len(chunks):
                chunk = chunks[c]
                if chunk is not None and chunk[slot & MASK] != FREE:
                    return slot
            return None
        return self.index.get(key)

    def key_of(self, slot: int) -> int:
        if slot < self.sparse_base:
            return slot - self.lists
        return self.sparse_keys[slot - self.sparse_base]

    def new(self, key: int) -> int:
        """Give ``key`` (holding no slot) a slot: loose, every column 0."""
        if not self.decided:
            self.decided = True
            if not 0 <= key < DIRECT:  # hashes: no direct region at all
                self.direct, self.sparse_base = 0, self.lists
        if 0 <= key < self.direct:
            slot = key + self.lists
        elif self.sparse_free:
            slot = self.sparse_free.pop()
            self.sparse_keys[slot - self.sparse_base] = key
            self.index[key] = slot
        else:
            slot = self.sparse_base + len(self.sparse_keys)
            self.sparse_keys.append(key)
            self.index[key] = slot
        c = slot >> SHIFT
        chunks = self.owner.chunks
        if c >= len(chunks) or chunks[c] is None:
            for column in self.all_columns():
                column.ensure_row(slot)
        self.owner[slot] = LOOSE
        return slot

    def release(self, slot: int) -> None:
        """Free ``slot`` (loose): its key holds no slot any more, its columns are 0."""
        if slot >= self.sparse_base:
            i = slot - self.sparse_base
            del self.index[self.sparse_keys[i]]
            self.sparse_keys[i] = NO_KEY
            self.sparse_free.append(slot)
        for column in self.columns:
            column[slot] = 0
        self.owner[slot] = FREE

    def move_key(self, slot: int, key: int) -> int:
        """Give the loose or listed ``slot``'s state to ``key`` (holding no slot): a
        new slot with the same columns, in the same place of the same list."""
        new = self.new(key)
        for column in self.columns:
            column[new] = column[slot]
        lst = self.owner[slot]
        if lst >= 0:
            self.insert_before(slot, new, lst)
            self.unlink(slot)
        self.release(slot)
        return new

    def keys_where(self, lists: tuple[int, ...]) -> Iterator[int]:
        """Keys of the slots in any of ``lists`` (slot order, not list order)."""
        wanted = lists.__contains__
        base = self.lists
        for c, chunk in enumerate(self.owner.chunks):
            if chunk is None:
                continue
            first = c << SHIFT
            if first >= self.sparse_base + len(self.sparse_keys):
                break
            for slot in compress(range(first, first + ROWS), map(wanted, chunk)):
                if slot >= base:
                    yield self.key_of(slot)

    # -- lists ----------------------------------------------------------------------------

    def slot_list(self, lst: int) -> list[int]:
        """Return one list's slots oldest first."""
        out: list[int] = []
        nxt = self.next
        slot = nxt[lst]
        while slot != lst:
            out.append(slot)
            slot = nxt[slot]
        return out

    def insert_before(self, anchor: int, slot: int, lst: int) -> None:
        """Link ``slot`` (loose) right before ``anchor``, a member or sentinel of ``lst``."""
        prev, nxt = self.prev, self.next
        before = prev.chunks[anchor >> SHIFT][anchor & MASK]  # type: ignore[index]
        prev[slot] = before
        nxt[slot] = anchor
        nxt[before] = slot
        prev[anchor] = slot
        self.owner[slot] = lst
        self.count[lst] += 1

    def append(self, lst: int, slot: int) -> None:
        """Link ``slot`` at the newest end of list ``lst``."""
        self.insert_before(lst, slot, lst)

    def append_keys(self, lst: int, keys: array[int]) -> list[int]:
        """Give each of ``keys`` (holding no slot) a new slot linked in order at the
        newest end of ``lst``; returns the slots. What ``new`` + ``append`` per key
        do, with the chunks made writable once (bulk adoption at mount)."""
        slots = [self.new(key) for key in keys]
        if not slots:
            return slots
        prev, nxt, owner = self.prev, self.next, self.owner
        before = prev[lst]
        touched = {slot >> SHIFT for slot in slots} | {before >> SHIFT}  # the old tail too
        for column in (prev, nxt, owner):
            for c in touched:
                column.writable(c)
        pc, nc, oc = prev.chunks, nxt.chunks, owner.chunks
        for slot in slots:
            c, i = slot >> SHIFT, slot & MASK
            pc[c][i] = before  # type: ignore[index]
            oc[c][i] = lst  # type: ignore[index]
            nc[before >> SHIFT][before & MASK] = slot  # type: ignore[index]
            before = slot
        nxt[before] = lst
        prev[lst] = before
        self.count[lst] += len(slots)
        return slots

    def adopt_keys(
        self,
        lst: int,
        keys: array[int],
        fills: list[tuple[SlotColumn, int | array[int]]],
        spans: list[tuple[int, int]] | None = None,
    ) -> None:
        """On a table that never held a key: give each of ``keys`` (distinct, below
        ``DIRECT``) its slot, linked in order at the newest end of ``lst``, and set
        each ``fills`` column to its constant or to its value per key (aligned with
        ``keys``). What ``new`` + ``append`` + column writes per key do, as C-level
        slice writes per run of consecutive keys (a first mount of 10^7 files);
        ``spans``: those runs (``runs(keys)``) if the caller knows them."""
        assert not self.decided
        n = len(keys)
        if not n:
            return
        if min(keys) < 0 or max(keys) >= DIRECT:
            raise ValueError("adopt_keys: keys must be direct")
        self.decided = True
        base = self.lists
        columns = self.all_columns()
        prev, nxt, owner = self.prev, self.next, self.owner
        before = prev[lst]
        for i, j in _pieces(runs(keys) if spans is None else spans, keys, base):
            start = keys[i] + base
            c, pos = start >> SHIFT, start & MASK
            k = j - i  # slots start .. start + k - 1, all in chunk c
            for column in columns:
                column.ensure_row(start)
            nxt[before] = start
            links = array(LINK, range(start - 1, start + k - 1))
            links[0] = before
            prev.writable(c)[pos : pos + k] = links
            nxt.writable(c)[pos : pos + k] = array(LINK, range(start + 1, start + k + 1))
            owner.writable(c)[pos : pos + k] = array("b", [lst]) * k
            for column, source in fills:
                if isinstance(source, int):
                    column.assign_constant(c, pos, k, source)
                else:
                    column.assign(c, pos, source[i:j])
            before = start + k - 1
        nxt[before] = lst
        prev[lst] = before
        self.count[lst] += n

    def unlink(self, slot: int) -> int:
        """Take ``slot`` out of its list (it becomes loose) and return the list."""
        prev, nxt = self.prev, self.next
        c, i = slot >> SHIFT, slot & MASK
        before, after = prev.chunks[c][i], nxt.chunks[c][i]  # type: ignore[index]
        nxt[before] = after
        prev[after] = before
        lst = self.owner.chunks[c][i]  # type: ignore[index]
        self.owner[slot] = LOOSE
        self.count[lst] -= 1
        return lst

    def first(self, lst: int) -> int | None:
        """Return the oldest slot of list ``lst``, or None if it is empty."""
        slot = self.next[lst]
        return None if slot == lst else slot

    def slots(self, lst: int) -> Iterator[int]:
        """Iterate one list's slots oldest first; the lists must not change meanwhile."""
        slot = self.next[lst]
        while slot != lst:
            yield slot
            slot = self.next[slot]

    def walk(self, lst: int) -> Iterator[int]:
        """Yield the keys of one list oldest first, tolerating removal of the yielded key.

        If both the yielded key and its successor left the list meanwhile, the walk
        restarts from the oldest end (callers filter keys they have already seen).
        """
        nxt, owner = self.next, self.owner
        slot = nxt[lst]
        while slot != lst:
            after = nxt[slot]
            key = self.key_of(slot)
            yield key
            if owner[slot] == lst and self.key_of(slot) == key:
                slot = nxt[slot]
            elif after == lst or owner[after] == lst:
                slot = after
            else:
                slot = nxt[lst]
