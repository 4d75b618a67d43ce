"""A row's life below the views: filled from an inode record, costed in the image,
stripped and freed (``Rows``: names, xattrs and unit maps together, which is
everything an :class:`kvfs.index.inodes.Inode` view reads)."""

from __future__ import annotations

import stat
from array import array

from kvfs.format.nsparts import GRANULE, ROOT_INO
from kvfs.format.records import InodeRecord
from kvfs.index.names import Names
from kvfs.index.state import F_DEAD, F_INTERNAL, _Dir
from kvfs.index.unitmaps import UnitMaps
from kvfs.index.xattrs import Xattrs

INDEX_LOAD = 0.375
"""The name index's lowest load (right after it doubles): the most bytes a name costs."""


class Rows(Names, Xattrs, UnitMaps):
    """Rows: created, costed, stripped and freed."""

    def _new_row(self, rec: InodeRecord) -> None:
        ino = rec.ino
        self._ensure(ino + 1)
        self._mode[ino] = rec.mode
        self._set_owner(ino, rec.uid, rec.gid)
        self._nlink[ino] = rec.nlink
        self._flags[ino] = rec.flags & ~F_INTERNAL
        self._size[ino] = rec.size
        self._set_times(ino, rec.atime_ns, rec.mtime_ns, rec.ctime_ns)
        self._parent[ino] = ROOT_INO if ino == ROOT_INO else 0  # the root's '..' is itself
        self._name_len[ino] = 0
        self._xattr[ino] = 0
        self._lookups[ino] = 0
        self._set_map(ino, rec.units, rec.csums)
        if stat.S_ISDIR(rec.mode):
            self._dirs[ino] = _Dir()
        self._live += 1
        if ino >= self.next_ino:
            self.next_ino = ino + 1

    def image_cost(self, ino: int) -> int:
        """Bytes inode ``ino`` takes in a checkpoint image: its row of every persisted
        column, its name index slot (at the index's highest load) and listing entry,
        its name and xattrs in the arena, a unit map or checksums in a side table."""
        row = sum(array(c.code).itemsize for c in self.persisted_columns)
        name = -(-self._name_len[ino] // GRANULE) * GRANULE
        xattrs = self._xattrs(ino)
        extra = sum(4 + len(v) for v in xattrs.values()) + 8 if xattrs else 0
        entry = self._maps.get(ino)
        if entry is not None:
            extra += 16 * len(entry[0]) + 12
        elif ino in self._multi:
            extra += 8 * len(self._multi[ino]) + 12
        return row + int(4 / INDEX_LOAD) + 4 + name + extra

    def _strip_row(self, ino: int) -> None:
        """A dropped row keeps only its F_DEAD flag (and the kernel's lookup count):
        its name, xattrs and unit map are released and every other column zeroed,
        so chunks of dropped rows shrink in (or leave) the checkpoint image at once,
        while the number stays unused until the kernel forgets it (no ESTALE
        answered with another file's attributes)."""
        if not self._mode[ino]:
            return  # stripped already
        if self._name_len[ino]:
            self._release_name(ino)
        self._drop_xattrs(ino)
        self._maps.pop(ino, None)
        self._multi.pop(ino, None)
        self._opens.pop(ino, None)
        for col in (*self.persisted_columns, self._cpos):
            col[ino] = 0
        self._flags[ino] = F_DEAD

    def _free_row(self, ino: int) -> None:
        """Return a dropped row for reuse (nothing can name it any more)."""
        if not self._mode[ino] and not self._flags[ino]:
            return  # free already: never twice on the free list (two files, one row)
        self._strip_row(ino)
        self._flags[ino] = 0
        self._lookups[ino] = 0
        self._free.append(ino)
