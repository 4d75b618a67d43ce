"""Rows and the views that name them: allocation, dropping, reclaiming a dropped
row once nothing names it (``Lifecycle``, a mixin of
:class:`kvfs.index.namespace.Namespace`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from kvfs.format.records import Op
from kvfs.index.inodes import Inode, InodeTable
from kvfs.index.rows import Rows
from kvfs.index.state import F_DEAD


class Lifecycle(Rows):
    """The inode table (interned views) over the rows, and a row's end."""

    def __init__(self, log: Callable[[list[Op]], None]) -> None:
        super().__init__(log)
        self.inodes = InodeTable(self)
        self._zombies: weakref.WeakValueDictionary[int, Inode] = weakref.WeakValueDictionary()
        """Views of dropped rows still held (an open, unlinked file): their rows wait."""

    def _alloc_ino(self) -> int:
        if not self._free and self._deferred:
            self._reclaim()
        if self._free:
            return self._free.pop()
        ino = self.next_ino
        self.next_ino += 1
        return ino

    def _reclaim(self) -> None:
        """Free dropped rows no view names any more (those the kernel still knows
        are stripped now and freed by :meth:`kernel_forget`)."""
        keep = []
        for ino in self._deferred:
            if ino in self._zombies:
                keep.append(ino)
            elif self._lookups[ino]:
                self._strip_row(ino)
                self._ghosts.add(ino)
            else:
                self._free_row(ino)
        self._deferred = keep
        self._reclaim_at = 2 * len(keep) + 32  # amortized O(1) per drop

    def _kill(self, ino: int) -> None:
        """The row leaves the namespace (names first, if any are left)."""
        for parent, name in self._names(ino):
            self._del_name(parent, name)
        self._flags[ino] |= F_DEAD
        self._live -= 1
        self._dirs.pop(ino, None)
        view = self.inodes.views.pop(ino, None)
        if view is not None:  # a view may still read it (an open, unlinked file)
            self._zombies[ino] = view
            self._deferred.append(ino)
            if len(self._deferred) >= self._reclaim_at:
                self._reclaim()
        elif self._lookups[ino]:
            self._strip_row(ino)
            self._ghosts.add(ino)
        else:
            self._free_row(ino)

    def kernel_forget(self, ino: int, count: int) -> None:
        """FUSE forget of a dropped inode: its number is reused once the kernel
        holds no reference (never while it may still name the old file: ESTALE)."""
        if not (0 < ino < self.next_ino) or not self._flags[ino] & F_DEAD:
            return
        left = max(0, self._lookups[ino] - count)
        self._lookups[ino] = left
        if not left and ino in self._ghosts:
            self._ghosts.discard(ino)
            self._free_row(ino)
