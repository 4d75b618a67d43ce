"""Bulk reads over whole column chunks (``Scans``, a mixin of
:class:`kvfs.index.namespace.Namespace`): recovery's unfinished files, a mount's
usage counters and unit claims, the evictor's file list."""

from __future__ import annotations

import stat
from array import array
from collections import Counter
from itertools import compress

from kvfs.format.nsparts import ROOT_INO
from kvfs.format.records import FLAG_QUARANTINED, FLAG_WRITING, NO_UNIT
from kvfs.index.columns import SHIFT
from kvfs.index.lifecycle import Lifecycle
from kvfs.index.state import F_DEAD, F_INTERNAL, F_NAMED


class Scans(Lifecycle):
    """C-level passes over the columns, no view per file."""

    def scan_inodes(self, flag_mask: int) -> list[int]:
        """Live inodes (root excluded) with a flag in ``flag_mask`` or no link:
        recovery's "unfinished" files, found with C-level scans of whole chunks."""
        clean = bytes(b for b in range(256) if not b & flag_mask & ~F_INTERNAL)
        found = []
        end = self.next_ino
        chunks = zip(self._mode.chunks, self._flags.chunks, self._nlink.chunks, strict=True)
        for c, (modes, flags, nlinks) in enumerate(chunks):
            base = c << SHIFT
            if base >= end:
                break
            if not flags.tobytes().translate(None, clean) and nlinks.count(0) == modes.count(0):
                continue  # (a free row has mode 0 and nlink 0)
            for i, m in enumerate(modes):
                ino = base + i
                live = m and ino != ROOT_INO and not flags[i] & F_DEAD
                if live and (flags[i] & flag_mask & ~F_INTERNAL or not nlinks[i]):
                    found.append(ino)
        return found

    def dropped_at_mount(self) -> list[int]:
        """The files a mount drops before anything else sees the index: left
        mid-write by a crash, quarantined, or unlinked while open (no link)."""
        return self.scan_inodes(FLAG_WRITING | FLAG_QUARANTINED)

    def mapped_by_directory(self) -> tuple[Counter[int], Counter[int], list[int]]:
        """(units mapped by named files per parent directory, the same per owner uid,
        the root's subdirectories): what a mount's usage counters start from, in
        C-level passes over whole chunks (``itertools.compress`` + ``Counter``), not
        one Python step per file. A file counts for the directory of its indexed
        name (``Inode.parent``)."""
        parents: Counter[int] = Counter()
        owners: Counter[int] = Counter()  # owner-table id -> units
        # flags byte -> 1 for a row that has a name and is not dead (a file without a
        # name has no F_NAMED: ``_del_name`` gives it another name's, or clears it)
        named = bytes(int(bool(f & F_NAMED and not f & F_DEAD)) for f in range(256))
        end = self.next_ino
        columns = (self._unit0, self._flags, self._parent, self._owner)
        chunks = zip(*(col.chunks for col in columns), strict=False)
        for c, (u0, fl, par, own) in enumerate(chunks):
            if c << SHIFT >= end:
                break
            raw = u0.tobytes()
            if raw.count(0) == len(raw):  # (bytes.count: C speed; array.count is not)
                continue  # no compact map here (directories, side maps, free rows)
            # the rows with a first unit, then of those the named ones: iterators only
            sel = bytes(compress(fl.tobytes().translate(named), u0))
            here = Counter(compress(compress(par, u0), sel))
            parents.update(here)
            raw = own.tobytes()
            if raw.count(0) == len(raw):  # one owner: the usual pool
                owners[0] += here.total()
            else:
                owners.update(compress(compress(own, u0), sel))
        # further units of contiguous multi-unit files; general (side) maps
        extra = [(ino, len(csums) - 1) for ino, csums in self._multi.items()]
        extra += [(ino, len(u) - u.count(NO_UNIT)) for ino, (u, _) in self._maps.items()]
        for ino, units in extra:
            if ino in self.inodes and self._nlink[ino] and units:
                parents[self._parent[ino]] += units
                owners[self._owner[ino]] += units
        uids: Counter[int] = Counter()
        for oid, units in owners.items():
            uids[self._owners[oid][0] if self._owners else 0] += units
        tops = [d for d in self._dirs if d != ROOT_INO and self._parent[d] == ROOT_INO]
        return parents, uids, tops

    def parent_of(self, ino: int) -> int:
        """The directory of the inode's indexed name (``Inode.parent``, no view made)."""
        return self._parent[ino]

    def unit_columns(self) -> tuple[list[array[int]], list[tuple[int, int]]]:
        """Every unit a live file maps, for the mount's bulk claim: the first-unit
        column's chunks (address + 1 per row, 0 none) and, as (first, count), the
        extents those leave out (the further units of contiguous multi-unit files,
        general maps)."""
        rest = []
        for ino, csums in self._multi.items():
            first = self._unit0[ino] - 1
            if len(csums) > 1:
                rest.append((first + 1, len(csums) - 1))
        for units, _ in self._maps.values():
            rest.extend((p, 1) for p in units if p != NO_UNIT)
        return self._unit0.chunks, rest

    def file_rows(self) -> list[tuple[int, int, int]]:
        """(inode, size, mtime_ns) of every live file, without views."""
        out = []
        end = self.next_ino
        cols = zip(
            self._mode.chunks,
            self._flags.chunks,
            self._size.chunks,
            self._mtime.chunks,
            strict=True,
        )
        for c, (modes, flags, sizes, mtimes) in enumerate(cols):
            base = c << SHIFT
            if base >= end:
                break
            for i, m in enumerate(modes):
                if m and stat.S_ISREG(m) and not flags[i] & F_DEAD:
                    out.append((base + i, sizes[i], mtimes[i]))
        return out
