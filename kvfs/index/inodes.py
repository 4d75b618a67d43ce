"""Views over the namespace's columns: :class:`Inode`, a directory's entries, the
inode table. A view holds no state of its own beyond (namespace, inode number).

The inode table interns live views (one object per live inode while anyone holds
it), so ``ns.inodes.get(i) is inode`` means "the same live file". A view of a
dropped inode keeps reading the dropped row, which is not reused while the view
lives (see ``Namespace.drop``). Views read and write the rows of
:class:`kvfs.index.rows.Rows` (the namespace below its facade).
"""

from __future__ import annotations

import stat
import weakref
from collections.abc import Iterator, Mapping

from kvfs.format.records import FLAG_GONE, NO_UNIT, InodeRecord
from kvfs.index.columns import MASK, SHIFT
from kvfs.index.rows import Rows
from kvfs.index.state import F_DEAD, F_INTERNAL, F_NAMED


class Inode:
    """One file or directory, read and written through the namespace's columns."""

    __slots__ = ("__weakref__", "_ns", "ino")

    def __init__(self, ns: Rows, ino: int) -> None:
        self._ns = ns
        self.ino = ino

    def __repr__(self) -> str:
        return f"Inode({self.ino}, mode={self.mode:o}, size={self.size})"

    @property
    def mode(self) -> int:
        return self._ns._mode[self.ino]

    @mode.setter
    def mode(self, value: int) -> None:
        self._ns._mode[self.ino] = value

    @property
    def uid(self) -> int:
        return self._ns._owners[self._ns._owner[self.ino]][0]

    @uid.setter
    def uid(self, value: int) -> None:
        self._ns._set_owner(self.ino, value, self.gid)

    @property
    def gid(self) -> int:
        return self._ns._owners[self._ns._owner[self.ino]][1]

    @gid.setter
    def gid(self, value: int) -> None:
        self._ns._set_owner(self.ino, self.uid, value)

    @property
    def nlink(self) -> int:
        return self._ns._nlink[self.ino]

    @nlink.setter
    def nlink(self, value: int) -> None:
        self._ns._nlink[self.ino] = value

    @property
    def size(self) -> int:
        return self._ns._size[self.ino]

    @size.setter
    def size(self, value: int) -> None:
        self._ns._size[self.ino] = value

    def times(self) -> tuple[int, int, int]:
        """(atime, mtime, ctime) in ns."""
        return self._ns.times(self.ino)

    def touch(self, now: int = 0) -> None:
        """Content changed: mtime and ctime = ``now`` (default: the clock)."""
        self._ns._touch(self.ino, now)

    def set_times(self, atime: int, mtime: int, ctime: int) -> None:
        """All three at once (ns; InvalidArgument when the columns cannot hold them)."""
        self._ns._set_times(self.ino, atime, mtime, ctime)

    @property
    def atime_ns(self) -> int:
        return self._ns.times(self.ino)[0]

    @atime_ns.setter
    def atime_ns(self, value: int) -> None:
        _, mtime, ctime = self._ns.times(self.ino)
        self._ns._set_times(self.ino, value, mtime, ctime)

    @property
    def mtime_ns(self) -> int:
        return self._ns._mtime[self.ino]

    @mtime_ns.setter
    def mtime_ns(self, value: int) -> None:
        atime, _, ctime = self._ns.times(self.ino)
        self._ns._set_times(self.ino, atime, value, ctime)

    @property
    def ctime_ns(self) -> int:
        return self._ns.times(self.ino)[2]

    @ctime_ns.setter
    def ctime_ns(self, value: int) -> None:
        atime, mtime, _ = self._ns.times(self.ino)
        self._ns._set_times(self.ino, atime, mtime, value)

    @property
    def flags(self) -> int:
        """FLAG_WRITING | FLAG_QUARANTINED | FLAG_GONE (internal bits hidden)."""
        return self._ns._flags[self.ino] & ~F_INTERNAL

    @flags.setter
    def flags(self, value: int) -> None:
        col = self._ns._flags
        col[self.ino] = (col[self.ino] & F_INTERNAL) | (value & ~F_INTERNAL)

    @property
    def lookups(self) -> int:
        """Kernel references (FUSE lookup count); runtime only."""
        return self._ns._lookups[self.ino]

    @lookups.setter
    def lookups(self, value: int) -> None:
        self._ns._lookups[self.ino] = value

    @property
    def opens(self) -> int:
        """Open handles; runtime only, kept for open files alone."""
        return self._ns._opens.get(self.ino, 0)

    @opens.setter
    def opens(self, value: int) -> None:
        if value:
            self._ns._opens[self.ino] = value
        else:
            self._ns._opens.pop(self.ino, None)

    @property
    def parent(self) -> int:
        """The directory of the inode's last name (a hint for a hard-linked file)."""
        return self._ns._parent[self.ino]

    @property
    def name(self) -> bytes:
        return self._ns._name(self.ino)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self._ns._mode[self.ino])

    @property
    def entries(self) -> DirView | None:
        return DirView(self._ns, self.ino) if self.is_dir else None

    @property
    def xattrs(self) -> dict[bytes, bytes] | None:
        """A decoded copy (change them with ``Namespace.set_xattr``)."""
        return self._ns._xattrs(self.ino)

    # ---------------------------------------------------------------- unit map
    @property
    def nunits(self) -> int:
        return self._ns._nunits(self.ino)

    def unit(self, u: int) -> int:
        """Physical address of logical unit ``u``; NO_UNIT for a hole or past the map."""
        return self._ns._unit(self.ino, u)

    def csum(self, u: int) -> int:
        return self._ns._csum(self.ino, u)

    @property
    def units(self) -> tuple[int, ...]:
        """The unit map as a tuple (a copy: change it through ``Namespace.edit_map``;
        for one unit use :meth:`unit`, which copies nothing)."""
        return tuple(self._ns._units(self.ino))

    @property
    def csums(self) -> tuple[int, ...]:
        return tuple(self._ns._csums(self.ino))

    @property
    def mapped_units(self) -> int:
        """Units of data the file holds on the devices (holes excluded)."""
        return self._ns._mapped(self.ino)

    def record(self) -> InodeRecord:
        # every rename, unlink and commit logs records: the row's chunks are read
        # directly (a read needs no copy-on-write), not through a property per field
        ns, ino = self._ns, self.ino
        c, r = ino >> SHIFT, ino & MASK
        uid, gid = ns._owners[ns._owner.chunks[c][r]]
        mtime = ns._mtime.chunks[c][r]
        return InodeRecord(
            ino,
            ns._mode.chunks[c][r],
            uid,
            gid,
            ns._nlink.chunks[c][r],
            ns._size.chunks[c][r],
            ns._atime.chunks[c][r] + mtime,
            mtime,
            ns._ctime.chunks[c][r] + mtime,
            ns._flags.chunks[c][r] & ~(F_INTERNAL | FLAG_GONE),
            ns._units(ino),
            ns._csums(ino),
        )


class DirView:
    """A directory's entries (name -> inode number), read-only: change them through
    the namespace's methods."""

    __slots__ = ("_ns", "ino")

    def __init__(self, ns: Rows, ino: int) -> None:
        self._ns = ns
        self.ino = ino

    def get(self, name: bytes, default: int | None = None) -> int | None:
        found = self._ns._find(self.ino, name)
        return found if found else default

    def __getitem__(self, name: bytes) -> int:
        found = self._ns._find(self.ino, name)
        if not found:
            raise KeyError(name)
        return found

    def __contains__(self, name: object) -> bool:
        return isinstance(name, bytes) and self._ns._find(self.ino, name) != 0

    def __len__(self) -> int:
        d = self._ns._dirs.get(self.ino)
        return 0 if d is None else len(d.children) + len(d.links or ())

    def __bool__(self) -> bool:
        return len(self) > 0

    def items(self) -> list[tuple[bytes, int]]:
        d = self._ns._dirs.get(self.ino)
        if d is None:
            return []
        name = self._ns._name
        out = [(name(child), child) for child in d.children]
        if d.links:
            out.extend(d.links.items())
        return out

    def keys(self) -> list[bytes]:
        return [n for n, _ in self.items()]

    def values(self) -> list[int]:
        return [i for _, i in self.items()]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())


class InodeTable(Mapping[int, Inode]):
    """``ns.inodes``: the live inodes by number (views, interned in ``views``)."""

    __slots__ = ("_ns", "views")

    def __init__(self, ns: Rows) -> None:
        self._ns = ns
        self.views: weakref.WeakValueDictionary[int, Inode] = weakref.WeakValueDictionary()

    def get(self, ino: int, default: Inode | None = None) -> Inode | None:  # type: ignore[override]
        ns = self._ns
        if 0 < ino < ns.next_ino and ns._mode[ino] and not ns._flags[ino] & F_DEAD:
            view = self.views.get(ino)
            if view is None:
                view = self.views[ino] = Inode(ns, ino)
            return view
        return default

    def __getitem__(self, ino: int) -> Inode:
        inode = self.get(ino)
        if inode is None:
            raise KeyError(ino)
        return inode

    def __contains__(self, ino: object) -> bool:
        ns = self._ns
        return (
            isinstance(ino, int)
            and 0 < ino < ns.next_ino
            and ns._mode[ino] != 0
            and not ns._flags[ino] & F_DEAD
        )

    def __len__(self) -> int:
        return self._ns._live

    def __iter__(self) -> Iterator[int]:
        ns = self._ns
        end = ns.next_ino
        for c, (modes, flags) in enumerate(zip(ns._mode.chunks, ns._flags.chunks, strict=False)):
            base = c << SHIFT
            if base >= end:
                return
            if modes.count(0) == len(modes):
                continue
            for i, m in enumerate(modes):
                if m and not flags[i] & F_DEAD:
                    yield base + i


__all__ = ["F_DEAD", "F_INTERNAL", "F_NAMED", "NO_UNIT", "DirView", "Inode", "InodeTable"]
