"""Unit maps: where a file's data units are and their checksums (``UnitMaps``, a
mixin of :class:`kvfs.index.namespace.Namespace`).

A file in one contiguous extent is its first unit, that unit's checksum and its size
in the columns (the checksums of further units in a side table); other maps live in
a side table, and a file being written has a materialized map (``_edit_map``) that
``_fold`` puts back in compact form once the file is clean.
"""

from __future__ import annotations

from array import array

from kvfs.format.records import DEV_SHIFT, NO_UNIT
from kvfs.index.state import State


def compact_kind(units: array[int], csums: array[int]) -> int:
    """0: empty map; 1: one mapped unit; 2: one contiguous extent of several units;
    3: anything else (holes, several extents)."""
    n = len(units)
    if n == 0:
        return 0
    first = units[0]
    if first < 0 or len(csums) != n:
        return 3
    if n == 1:
        return 1
    last = first + n - 1
    if units[-1] != last or first >> DEV_SHIFT != last >> DEV_SHIFT:
        return 3
    if units != array("q", range(first, first + n)):
        return 3
    return 2


class UnitMaps(State):
    """A row's unit map, compact where it can be."""

    def _set_map(self, ino: int, units: array[int], csums: array[int]) -> None:
        self._maps[ino] = (array("q", units), array("Q", csums))
        self._multi.pop(ino, None)
        self._fold(ino)

    def _fold(self, ino: int) -> None:
        """A materialized map back to its compact form where it has one."""
        entry = self._maps.get(ino)
        if entry is None:
            return
        units, csums = entry
        kind = compact_kind(units, csums)
        if kind == 3:
            self._unit0[ino] = 0
            return
        del self._maps[ino]
        self._unit0[ino] = units[0] + 1 if kind else 0
        self._csum0[ino] = csums[0] if kind else 0
        if kind == 2:
            self._multi[ino] = csums

    def _edit_map(self, ino: int) -> tuple[array[int], array[int]]:
        """Row ``ino``'s unit map and checksums as mutable arrays, kept materialized
        until :meth:`_fold`."""
        entry = self._maps.get(ino)
        if entry is None:
            entry = self._maps[ino] = (self._units(ino), self._csums(ino))
            self._multi.pop(ino, None)
            self._unit0[ino] = 0
        return entry

    def _nunits(self, ino: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return len(entry[0])
        multi = self._multi.get(ino)
        if multi is not None:
            return len(multi)
        return 0 if self._unit0[ino] == 0 else 1

    def _unit(self, ino: int, u: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[0][u] if 0 <= u < len(entry[0]) else NO_UNIT
        if u == 0:
            return self._unit0[ino] - 1  # NO_UNIT for none
        multi = self._multi.get(ino)
        if multi is not None and 0 < u < len(multi):
            return self._unit0[ino] - 1 + u
        return NO_UNIT

    def _csum(self, ino: int, u: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[1][u] if 0 <= u < len(entry[1]) else 0
        multi = self._multi.get(ino)
        if multi is not None:
            return multi[u] if 0 <= u < len(multi) else 0
        return self._csum0[ino] if u == 0 and self._unit0[ino] else 0

    def _units(self, ino: int) -> array[int]:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[0]
        first = self._unit0[ino] - 1
        multi = self._multi.get(ino)
        if multi is not None:
            return array("q", range(first, first + len(multi)))
        return array("q") if first == NO_UNIT else array("q", (first,))

    def _csums(self, ino: int) -> array[int]:
        entry = self._maps.get(ino)
        if entry is not None:
            return entry[1]
        multi = self._multi.get(ino)
        if multi is not None:
            return multi[:]
        return array("Q", (self._csum0[ino],)) if self._unit0[ino] else array("Q")

    def _mapped(self, ino: int) -> int:
        entry = self._maps.get(ino)
        if entry is not None:
            return len(entry[0]) - entry[0].count(NO_UNIT)
        return self._nunits(ino)
