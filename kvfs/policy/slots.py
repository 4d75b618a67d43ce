"""The slot table shared by the policies: per-key state as parallel typed arrays.

No per-key Python objects except one dict entry (key -> slot): every other field is
one entry of a typed ``array`` column, and the lists a policy keeps (LRU order,
probation, main, ghosts, ...) are intrusive circular doubly linked lists threaded
through the ``prev``/``next`` columns, so moving a key between lists is O(1) and
allocates nothing.  Pure and synchronous.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

NO_KEY = -1
"""'No key' in key-valued columns and in persisted columns."""
FREE = -1
"""Owner of a slot that is in no list."""
LINK = "i"
"""Typecode of the link columns: int32, so a table holds at most 2**31 - 1 slots."""


class SlotTable:
    """Per-key state as parallel arrays indexed by slot, plus intrusive circular lists.

    ``index`` maps a key to its slot; every other per-key field is one entry of a
    typed column (the policy names each column's typecode), so a key costs one dict
    entry, one int object (the slot), 8 bytes of key, 2 x 4 bytes of links, one
    byte of list id and the columns' widths.  Slots ``0 .. lists-1`` are the lists' sentinels; freed
    slots are reused (a free-slot stack), so the arrays never shrink but never grow
    beyond the peak number of keys.  A slot is in at most one list (``owner``).
    """

    def __init__(self, lists: int, columns: Sequence[str]) -> None:
        self.index: dict[int, int] = {}
        self.key = array("q", [NO_KEY] * lists)
        self.prev = array(LINK, range(lists))
        self.next = array(LINK, range(lists))
        self.owner = array("b", range(lists))
        self.columns = [array(code, [0] * lists) for code in columns]
        self.count = [0] * lists
        self.free = array(LINK)

    def new(self, key: int) -> int:
        """Allocate a slot for ``key`` (in no list, every column 0) and index it."""
        if self.free:
            slot = self.free.pop()
            self.key[slot] = key
        else:
            slot = len(self.key)
            self.key.append(key)
            self.prev.append(slot)
            self.next.append(slot)
            self.owner.append(FREE)
            for column in self.columns:
                column.append(0)
        self.index[key] = slot
        return slot

    def extend(self, lst: int, keys: array[int]) -> int:
        """Give each of ``keys`` (none indexed yet) a new slot at the end of the arrays,
        every column 0, linked in order at the newest end of ``lst``: what ``new`` and
        ``append`` per key do on a table without free slots, with C-level bulk
        operations. Returns the first new slot (slots are consecutive)."""
        first, n = len(self.key), len(keys)
        if not n:
            return first
        self.key.extend(keys)
        self.index.update(zip(keys, range(first, first + n), strict=True))
        tail = self.prev[lst]
        self.prev.append(tail)
        self.prev.extend(range(first, first + n - 1))
        self.next.extend(range(first + 1, first + n))
        self.next.append(lst)
        self.next[tail] = first
        self.prev[lst] = first + n - 1
        self.owner.extend(array("b", [lst]) * n)
        for column in self.columns:
            column.extend(array(column.typecode, [0]) * n)
        self.count[lst] += n
        return first

    def slot_list(self, lst: int) -> list[int]:
        """Return one list's slots oldest first (``slots`` as a list, faster)."""
        out: list[int] = []
        nxt = self.next
        slot = nxt[lst]
        while slot != lst:
            out.append(slot)
            slot = nxt[slot]
        return out

    def release(self, slot: int) -> None:
        """Unindex the key of ``slot`` (in no list) and free the slot."""
        del self.index[self.key[slot]]
        self.key[slot] = NO_KEY
        for column in self.columns:
            column[slot] = 0
        self.free.append(slot)

    def insert_before(self, anchor: int, slot: int, lst: int) -> None:
        """Link ``slot`` (in no list) right before ``anchor``, a member or sentinel of ``lst``."""
        before = self.prev[anchor]
        self.prev[slot] = before
        self.next[slot] = anchor
        self.next[before] = slot
        self.prev[anchor] = slot
        self.owner[slot] = lst
        self.count[lst] += 1

    def append(self, lst: int, slot: int) -> None:
        """Link ``slot`` at the newest end of list ``lst``."""
        self.insert_before(lst, slot, lst)

    def unlink(self, slot: int) -> int:
        """Take ``slot`` out of its list and return the list."""
        before, after = self.prev[slot], self.next[slot]
        self.next[before] = after
        self.prev[after] = before
        lst = self.owner[slot]
        self.owner[slot] = FREE
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
        slot = self.next[lst]
        while slot != lst:
            after = self.next[slot]
            key = self.key[slot]
            yield key
            if self.owner[slot] == lst and self.key[slot] == key:
                slot = self.next[slot]
            elif after == lst or self.owner[after] == lst:
                slot = after
            else:
                slot = self.next[lst]
