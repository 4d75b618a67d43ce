"""The in-memory index: inodes, directories, xattrs. Pure and synchronous.

Every mutation changes the in-memory state and hands the journal operations that
reproduce it to ``log`` (one call = one atomic transaction); recovery feeds the same
operations to :meth:`Namespace.apply`. No method awaits, so under trio each one is
atomic with respect to every other request.

:class:`Namespace` is the facade the store calls: the queries and mutations of the
file system are here, composed over mixins one concern each — the state and its
row primitives (:mod:`kvfs.index.state`), names (:mod:`kvfs.index.names`), xattrs
(:mod:`kvfs.index.xattrs`), unit maps (:mod:`kvfs.index.unitmaps`), a row's life
(:mod:`kvfs.index.rows`, :mod:`kvfs.index.lifecycle`), bulk reads
(:mod:`kvfs.index.scans`), the checkpoint image (:mod:`kvfs.index.checkpoint`) and
replay (:mod:`kvfs.index.replay`). :class:`Inode` is a view
(:mod:`kvfs.index.inodes`).
"""

from __future__ import annotations

import stat
import time
from array import array

from kvfs.common.errors import (
    Exists,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoAttribute,
    NoSpace,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    Stale,
)
from kvfs.format.nsparts import ROOT_INO
from kvfs.format.records import (
    FLAG_GONE,
    FLAG_WRITING,
    Blob,
    Dentry,
    Drop,
    InodeRecord,
    Op,
    Undentry,
    Xattr,
)
from kvfs.index.columns import SHIFT, Column
from kvfs.index.inodes import DirView, Inode
from kvfs.index.names import NAME_MAX, check_name
from kvfs.index.replay import EVICTOR_TAG, Replay
from kvfs.index.scans import Scans
from kvfs.index.state import F_NAMED, check_times
from kvfs.index.xattrs import XATTR_FILE_MAX, XATTR_NAME_MAX, XATTR_VALUE_MAX, check_xattr_room

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class Namespace(Replay, Scans):
    """Inode table and directory tree."""

    # ------------------------------------------------------------------ queries
    def get(self, ino: int) -> Inode:
        """The inode the kernel names by number; Stale (ESTALE) if it is gone."""
        inode = self.inodes.get(ino)
        if inode is None or inode.flags & FLAG_GONE:
            raise Stale(f"inode {ino} is gone")
        return inode

    def mapped_units_of(self, ino: int) -> int:
        """Units of data inode ``ino`` holds on the devices (0 for a number no live
        inode has), read from the columns: no view is made (a create sums this over
        every file its user holds open)."""
        return self._mapped(ino) if ino in self.inodes else 0

    def directory(self, ino: int) -> DirView:
        self.get(ino)
        if ino not in self._dirs:
            raise NotADirectory(f"inode {ino}")
        return DirView(self, ino)

    def lookup(self, parent: int, name: bytes) -> Inode:
        inode = self.find(parent, name)
        if inode is None:
            raise NotFound(name.decode(errors="replace"))
        return inode

    def find(self, parent: int, name: bytes) -> Inode | None:
        """:meth:`lookup` that answers a missing name with None instead of raising
        (FUSE LOOKUP: misses are most of a lookup storm, and a rename's new name)."""
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self.get(parent).parent)
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name of {len(name)} bytes")
        self.get(parent)
        if parent not in self._dirs:
            raise NotADirectory(f"inode {parent}")
        ino = self._find(parent, name)
        return self.inodes[ino] if ino else None

    # ------------------------------------------------------------------ mutations
    def init_root(self, uid: int, gid: int) -> None:
        now = time.time_ns()
        rec = InodeRecord(
            ROOT_INO, stat.S_IFDIR | 0o755, uid, gid, 2, 0, now, now, now, 0, array("q"), array("Q")
        )
        self._new_row(rec)
        self._log([self.inodes[ROOT_INO].record()])

    def make(
        self, parent: int, name: bytes, mode: int, uid: int, gid: int, flags: int = 0
    ) -> Inode:
        """Create a file or directory named ``name`` in ``parent``."""
        check_name(name)
        entries = self.directory(parent)
        if name in entries:
            raise Exists(name.decode(errors="replace"))
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise NotPermitted("only regular files and directories are supported")
        owner = (uid, gid)
        if owner not in self._owner_ids and len(self._owners) > 0xFFFF:
            raise NoSpace("more than 65536 distinct (uid, gid) owners")
        now = time.time_ns()
        is_dir = stat.S_ISDIR(mode)
        ino = self._alloc_ino()
        empty_u, empty_c = array("q"), array("Q")
        rec = InodeRecord(
            ino, mode, uid, gid, 2 if is_dir else 1, 0, now, now, now, flags, empty_u, empty_c
        )
        self._new_row(rec)
        self._add_name(parent, name, ino)
        dir_inode = self.inodes[parent]
        dir_inode.touch(now)
        dir_inode.nlink += is_dir
        inode = self.inodes[ino]
        self._log([inode.record(), Dentry(parent, name, ino), dir_inode.record()])
        return inode

    def add_files(
        self,
        parent: int,
        names: list[bytes],
        mode: int,
        owner: tuple[int, int],
        size: int,
        units: array[int],
        csums: array[int],
    ) -> int:
        """Bulk creation of committed one-unit files (``units[i]``, ``csums[i]``) in
        ``parent``, unlogged: for tools that build big pools (benchmarks). Columns
        are filled with C-level slices; returns the first new inode number."""
        assert len(names) == len(units) == len(csums) and stat.S_ISREG(mode)
        for name in names:
            check_name(name)
        first, n = self.next_ino, len(names)
        self.next_ino += n
        self._ensure(self.next_ino)
        now = time.time_ns()
        constant: list[tuple[Column, int]] = [
            (self._mode, mode),
            (self._owner, self._owner_id(*owner)),
            (self._nlink, 1),
            (self._flags, F_NAMED),
            (self._size, size),
            (self._atime, 0),
            (self._mtime, now),
            (self._ctime, 0),
            (self._parent, parent),
        ]
        for col, value in constant:
            col.fill(first, array(col.code, [value]) * n)
        self._unit0.fill(first, array("q", [u + 1 for u in units]))
        self._csum0.fill(first, csums)
        entries = [*map(self._forms.entry, names)]
        self._name_len.fill(first, array("B", map(len, entries)))
        put, insert = self._put_entry, self._index.insert
        self._name_off.fill(first, array("I", map(put, entries)))
        for i, name in enumerate(names):
            insert(parent, name, first + i)
        children = self._dirs[parent].own_children()
        self._cpos.fill(first, array("I", range(len(children), len(children) + n)))
        children.extend(range(first, first + n))
        self._live += n
        return first

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        inode = self.get(ino)
        if inode.is_dir:
            raise IsADirectory("hard link to a directory")
        check_name(name)
        entries = self.directory(parent)
        if name in entries:
            raise Exists(name.decode(errors="replace"))
        self._add_name(parent, name, ino)
        inode.nlink += 1
        inode.ctime_ns = time.time_ns()
        self._touch(parent)
        self._log([inode.record(), Dentry(parent, name, ino), self.inodes[parent].record()])
        return inode

    def names_of(self, inode: Inode) -> list[tuple[int, bytes]]:
        """Every (parent, name) of ``inode``."""
        return self._names(inode.ino)

    def remove(self, parent: int, name: bytes, want_dir: bool) -> Inode:
        """unlink (``want_dir`` False) or rmdir; returns the inode, maybe now nlink 0."""
        inode = self.lookup(parent, name)
        if want_dir and not inode.is_dir:
            raise NotADirectory(name.decode(errors="replace"))
        if not want_dir and inode.is_dir:
            raise IsADirectory(name.decode(errors="replace"))
        if want_dir and inode.entries:
            raise NotEmpty(name.decode(errors="replace"))
        ops = self._unlink_entry(parent, name, inode)
        self._log([*ops, Undentry(parent, name), self.inodes[parent].record()])
        return inode

    def _unlink_entry(self, parent: int, name: bytes, inode: Inode) -> list[Op]:
        self._del_name(parent, name)
        now = time.time_ns()
        self._touch(parent, now)
        if inode.is_dir:
            inode.ctime_ns = now
            inode.nlink = 0
            self.inodes[parent].nlink -= 1
        else:
            inode.nlink -= 1
            if inode.nlink or inode.opens:
                inode.ctime_ns = now
            # else nothing can see its ctime again (no name, no descriptor), and its
            # row goes: a stamp far from its mtime would widen its chunk for good
        return [inode.record()]

    def rename(
        self, old_parent: int, old: bytes, new_parent: int, new: bytes, flags: int = 0
    ) -> Inode | None:
        """POSIX rename; returns the inode that lost its name (to be dropped), if any."""
        check_name(new)
        src = self.lookup(old_parent, old)
        dst_entries = self.directory(new_parent)
        target_ino = dst_entries.get(new)
        if flags & RENAME_EXCHANGE:
            if target_ino is None:
                raise NotFound(new.decode(errors="replace"))
            self._exchange(old_parent, old, new_parent, new)
            return None
        if target_ino is not None and flags & RENAME_NOREPLACE:
            raise Exists(new.decode(errors="replace"))
        if target_ino == src.ino:
            return None
        if src.is_dir:
            self._check_not_ancestor(src.ino, new_parent)
        ops: list[Op] = []
        victim = None
        if target_ino is not None:
            victim = self.inodes[target_ino]
            if victim.is_dir != src.is_dir:
                raise (IsADirectory if victim.is_dir else NotADirectory)(new.decode())
            if victim.entries:
                raise NotEmpty(new.decode(errors="replace"))
            ops += self._unlink_entry(new_parent, new, victim)
        self._del_name(old_parent, old)
        self._add_name(new_parent, new, src.ino)
        now = time.time_ns()
        src.ctime_ns = now
        if src.is_dir and old_parent != new_parent:
            self.inodes[old_parent].nlink -= 1
            self.inodes[new_parent].nlink += 1
        self._touch(old_parent, now)
        self._touch(new_parent, now)
        ops += [Undentry(old_parent, old), Dentry(new_parent, new, src.ino), src.record()]
        ops.append(self.inodes[old_parent].record())
        if new_parent != old_parent:  # within one directory: its record once
            ops.append(self.inodes[new_parent].record())
        self._log(ops)
        return victim

    def _exchange(self, p1: int, n1: bytes, p2: int, n2: bytes) -> None:
        """renameat2(RENAME_EXCHANGE): ``p1/n1`` and ``p2/n2`` swap inodes. A directory
        moved to the other parent takes its '..' along (``parent``) and moves one link
        of its old parent's count to the new one; neither may land in its own subtree."""
        a, b = self.inodes[self._find(p1, n1)], self.inodes[self._find(p2, n2)]
        if a is b:
            return
        if p1 != p2:
            if a.is_dir:
                self._check_not_ancestor(a.ino, p2)
            if b.is_dir:
                self._check_not_ancestor(b.ino, p1)
            moved = a.is_dir - b.is_dir  # subdirectories p1 loses to p2
            self.inodes[p1].nlink -= moved
            self.inodes[p2].nlink += moved
        self._del_name(p1, n1)
        self._del_name(p2, n2)
        self._add_name(p2, n2, a.ino)
        self._add_name(p1, n1, b.ino)
        now = time.time_ns()
        a.ctime_ns = b.ctime_ns = now
        self._touch(p1, now)
        self._touch(p2, now)
        ops: list[Op] = [Dentry(p1, n1, b.ino), Dentry(p2, n2, a.ino), a.record(), b.record()]
        ops.append(self.inodes[p1].record())
        if p2 != p1:
            ops.append(self.inodes[p2].record())
        self._log(ops)  # the inodes' ctimes and the directories' mtimes and links too

    def _check_not_ancestor(self, ino: int, target_dir: int) -> None:
        cur = target_dir
        while True:
            if cur == ino:
                raise InvalidArgument("cannot move a directory into itself")
            if cur == ROOT_INO:
                return
            cur = self._parent[cur]

    def drop(self, inode: Inode) -> None:
        """Forget an inode that has no names left and no users."""
        assert inode.nlink == 0 or inode.flags & FLAG_WRITING
        self._kill(inode.ino)
        self._log([Drop(inode.ino)])

    def detach(self, parent: int, name: bytes) -> None:
        """Remove a name without logging (recovery repairs; a checkpoint follows)."""
        if self._find(parent, name):
            self._del_name(parent, name)

    def discard(self, ino: int) -> None:
        """Remove an inode without logging (recovery repairs; a checkpoint follows)."""
        if ino in self.inodes:
            self._kill(ino)

    def edit_map(self, inode: Inode) -> tuple[array[int], array[int]]:
        """The file's unit map and checksums as mutable arrays, kept materialized
        until :meth:`commit` of the file once it is no longer being written."""
        return self._edit_map(inode.ino)

    def commit(self, inode: Inode) -> None:
        """Log an inode's current persistent state; a file no longer being written
        gets its compact unit map back."""
        self._log([inode.record()])
        if not inode.flags & FLAG_WRITING:
            self._fold(inode.ino)

    def set_xattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        inode = self.get(ino)
        if len(name) > XATTR_NAME_MAX:
            raise NameTooLong("xattr name too long")
        xattrs = inode.xattrs
        if value is None and (not xattrs or name not in xattrs):
            raise NoAttribute(name.decode(errors="replace"))
        if value is not None:
            check_xattr_room(xattrs or {}, name, value)
        self._apply_xattr(Xattr(ino, name, value))
        inode.ctime_ns = time.time_ns()
        self._log([Xattr(ino, name, value), inode.record()])

    def get_xattr(self, ino: int, name: bytes) -> bytes:
        xattrs = self.get(ino).xattrs
        if not xattrs or name not in xattrs:
            raise NoAttribute(name.decode(errors="replace"))
        return xattrs[name]

    def set_blob(self, name: str, data: bytes) -> None:
        self.blobs[name] = data
        self._log([Blob(name, data)])


__all__ = [
    "EVICTOR_TAG",
    "RENAME_EXCHANGE",
    "RENAME_NOREPLACE",
    "ROOT_INO",
    "SHIFT",
    "XATTR_FILE_MAX",
    "XATTR_VALUE_MAX",
    "Inode",
    "Namespace",
    "check_name",
    "check_times",
    "check_xattr_room",
]
