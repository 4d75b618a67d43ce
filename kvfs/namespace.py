"""The in-memory index: inodes, directories, xattrs. Pure and synchronous.

Every mutation changes the in-memory state and hands the journal operations that
reproduce it to ``log`` (one call = one atomic transaction); recovery feeds the same
operations to :meth:`Namespace.apply`. No method awaits, so under trio each one is
atomic with respect to every other request.
"""

from __future__ import annotations

import gc
import stat
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvfs.errors import (
    Exists,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NoAttribute,
    NotADirectory,
    NotEmpty,
    NotFound,
    NotPermitted,
    Stale,
)
from kvfs.layout import (
    FLAG_GONE,
    FLAG_WRITING,
    NO_UNIT,
    Blob,
    Dentry,
    Drop,
    InodeRecord,
    Op,
    Undentry,
    Xattr,
)

ROOT_INO = 1
NAME_MAX = 255
XATTR_NAME_MAX = 255
XATTR_VALUE_MAX = 64 * 1024
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def _empty_units() -> array[int]:
    return array("q")


def _empty_csums() -> array[int]:
    return array("Q")


@dataclass(eq=False, slots=True)
class Inode:
    """One file or directory; persistent fields mirror :class:`InodeRecord`."""

    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    flags: int = 0
    units: array[int] = field(default_factory=_empty_units)
    csums: array[int] = field(default_factory=_empty_csums)
    entries: dict[bytes, int] | None = None
    parent: int = ROOT_INO
    name: bytes = b""
    xattrs: dict[bytes, bytes] | None = None
    lookups: int = 0
    opens: int = 0

    @property
    def is_dir(self) -> bool:
        return self.entries is not None

    @property
    def mapped_units(self) -> int:
        """Units of data the file holds on the devices (holes excluded); C-speed."""
        return len(self.units) - self.units.count(NO_UNIT)

    def record(self) -> InodeRecord:
        return InodeRecord(
            self.ino,
            self.mode,
            self.uid,
            self.gid,
            self.nlink,
            self.size,
            self.atime_ns,
            self.mtime_ns,
            self.ctime_ns,
            self.flags & ~FLAG_GONE,
            self.units,
            self.csums,
        )


@contextmanager
def building_index() -> Iterator[None]:
    """Build the index (recovery: millions of long-lived objects) with the cyclic
    garbage collector paused, and on success freeze what exists then out of future
    collections (``gc.freeze``): generational scans would otherwise walk the growing
    index again and again (a third of the time of a 10^6-file mount), and later
    full collections would walk it for nothing, since its objects are freed by
    reference counting (no cycles). Collects first, so no garbage is frozen."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise NameTooLong(f"name of {len(name)} bytes")
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise InvalidArgument(f"invalid name {name!r}")


class Namespace:
    """Inode table and directory tree."""

    def __init__(self, log: Callable[[list[Op]], None]) -> None:
        self._log = log
        self.inodes: dict[int, Inode] = {}
        self.blobs: dict[str, bytes] = {}
        self.next_ino = ROOT_INO + 1
        self._dirs = 0  # directories in ``inodes``, kept by every insert and removal

    @property
    def dir_count(self) -> int:
        """Directories in the index, the root included; O(1)."""
        return self._dirs

    @property
    def file_count(self) -> int:
        """Regular files in the index (unlinked ones still referenced included); O(1)."""
        return len(self.inodes) - self._dirs

    # ------------------------------------------------------------------ replay
    def apply(self, op: Op) -> bool:
        """Replay one journal operation (recovery); False when it was skipped because
        it names an inode that is not there. Tolerant by design: a checkpoint is
        fuzzy (each piece taken at another moment) and every transaction since it
        began is replayed over it, so an operation may meet the state after a later
        one (a name in a directory that is already dropped: that Drop follows in
        the replay). Operations set absolute state, so replaying them over any such
        snapshot ends in the live state (``docs/design.md``, "Checkpoints")."""
        if isinstance(op, InodeRecord):
            self._apply_record(op)
        elif isinstance(op, Dentry):
            parent = self.inodes.get(op.parent)
            if parent is None or parent.entries is None:
                return False
            child = self.inodes.get(op.ino)
            if child is None:
                parent.entries[op.name] = op.ino
            else:
                # the inodes' own int objects, not the op's copies (memory per file)
                parent.entries[op.name] = child.ino
                child.parent, child.name = parent.ino, op.name
        elif isinstance(op, Undentry):
            parent = self.inodes.get(op.parent)
            if parent is None or parent.entries is None:
                return False
            parent.entries.pop(op.name, None)
        elif isinstance(op, Drop):
            gone = self.inodes.pop(op.ino, None)
            if gone is not None and gone.entries is not None:
                self._dirs -= 1
        elif isinstance(op, Xattr):
            if op.ino not in self.inodes:
                return False
            self._apply_xattr(op)
        else:
            self.blobs[op.name] = op.data
        return True

    def _apply_record(self, rec: InodeRecord) -> None:
        inode = self.inodes.get(rec.ino)
        if inode is None:
            # built complete in one call (no default arrays made and then replaced)
            self.inodes[rec.ino] = Inode(
                rec.ino,
                rec.mode,
                rec.uid,
                rec.gid,
                rec.nlink,
                rec.size,
                rec.atime_ns,
                rec.mtime_ns,
                rec.ctime_ns,
                rec.flags,
                rec.units,
                rec.csums,
                {} if stat.S_ISDIR(rec.mode) else None,
            )
            self._dirs += stat.S_ISDIR(rec.mode)
            if rec.ino >= self.next_ino:
                self.next_ino = rec.ino + 1
            return
        inode.mode, inode.uid, inode.gid, inode.nlink = rec.mode, rec.uid, rec.gid, rec.nlink
        inode.size, inode.flags = rec.size, rec.flags
        inode.atime_ns, inode.mtime_ns, inode.ctime_ns = rec.atime_ns, rec.mtime_ns, rec.ctime_ns
        inode.units, inode.csums = rec.units, rec.csums

    def _apply_xattr(self, op: Xattr) -> None:
        inode = self.inodes[op.ino]
        if op.value is None:
            if inode.xattrs:
                inode.xattrs.pop(op.name, None)
            return
        if inode.xattrs is None:
            inode.xattrs = {}
        inode.xattrs[op.name] = op.value

    def snapshot(self) -> Iterator[Op]:
        """Every operation needed to rebuild the state (checkpoints), produced lazily
        and safe to interleave with mutations: the inode numbers are taken once (a
        C-speed copy), each inode, directory and blob is read when its turn comes,
        whatever it holds then (fuzzy: the journal replays every transaction since
        the first call over it). Inodes with their xattrs, then names, then blobs."""
        inos = list(self.inodes)
        inodes = self.inodes
        for ino in inos:
            inode = inodes.get(ino)
            if inode is None:
                continue
            yield inode.record()
            if inode.xattrs:
                for name, value in list(inode.xattrs.items()):
                    yield Xattr(ino, name, value)
        for ino in inos:
            inode = inodes.get(ino)
            if inode is None or not inode.entries:
                continue
            entries = inode.entries
            for name in list(entries):
                child = entries.get(name)
                if child is not None:
                    yield Dentry(ino, name, child)
        for blob_name in list(self.blobs):
            data = self.blobs.get(blob_name)
            if data is not None:
                yield Blob(blob_name, data)

    # ------------------------------------------------------------------ queries
    def get(self, ino: int) -> Inode:
        """The inode the kernel names by number; Stale (ESTALE) if it is gone."""
        inode = self.inodes.get(ino)
        if inode is None or inode.flags & FLAG_GONE:
            raise Stale(f"inode {ino} is gone")
        return inode

    def directory(self, ino: int) -> dict[bytes, int]:
        entries = self.get(ino).entries
        if entries is None:
            raise NotADirectory(f"inode {ino}")
        return entries

    def lookup(self, parent: int, name: bytes) -> Inode:
        if name == b".":
            return self.get(parent)
        if name == b"..":
            return self.get(self.get(parent).parent)
        if len(name) > NAME_MAX:
            raise NameTooLong(f"name of {len(name)} bytes")
        ino = self.directory(parent).get(name)
        if ino is None:
            raise NotFound(name.decode(errors="replace"))
        return self.inodes[ino]

    # ------------------------------------------------------------------ mutations
    def init_root(self, uid: int, gid: int) -> None:
        now = time.time_ns()
        root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, uid, gid, 2, 0, now, now, now, entries={})
        self._dirs += ROOT_INO not in self.inodes
        self.inodes[ROOT_INO] = root
        self._log([root.record()])

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
        now = time.time_ns()
        is_dir = stat.S_ISDIR(mode)
        inode = Inode(
            self.next_ino,
            mode,
            uid,
            gid,
            2 if is_dir else 1,
            0,
            now,
            now,
            now,
            flags=flags,
            entries={} if is_dir else None,
            parent=parent,
            name=name,
        )
        self.next_ino += 1
        self.inodes[inode.ino] = inode
        self._dirs += is_dir
        entries[name] = inode.ino
        dir_inode = self.inodes[parent]
        dir_inode.mtime_ns = dir_inode.ctime_ns = now
        dir_inode.nlink += is_dir
        self._log([inode.record(), Dentry(parent, name, inode.ino), dir_inode.record()])
        return inode

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        inode = self.get(ino)
        if inode.is_dir:
            raise IsADirectory("hard link to a directory")
        check_name(name)
        entries = self.directory(parent)
        if name in entries:
            raise Exists(name.decode(errors="replace"))
        entries[name] = ino
        inode.nlink += 1
        inode.ctime_ns = time.time_ns()
        self._touch_dir(parent)
        self._log([inode.record(), Dentry(parent, name, ino), self.inodes[parent].record()])
        return inode

    def names_of(self, inode: Inode) -> list[tuple[int, bytes]]:
        """Every (parent, name) of ``inode``: O(1) via its last-name hint for the
        usual single link, a directory scan only for hard-linked files."""
        hint = self.inodes.get(inode.parent)
        single = inode.nlink <= 1 and hint is not None and hint.entries is not None
        if single and hint.entries.get(inode.name) == inode.ino:  # type: ignore[union-attr]
            return [(inode.parent, inode.name)]
        return [
            (d.ino, n)
            for d in self.inodes.values()
            if d.entries
            for n, i in d.entries.items()
            if i == inode.ino
        ]

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
        entries = self.directory(parent)
        del entries[name]
        now = time.time_ns()
        self._touch_dir(parent, now)
        inode.ctime_ns = now
        if inode.is_dir:
            inode.nlink = 0
            self.inodes[parent].nlink -= 1
        else:
            inode.nlink -= 1
        return [inode.record()]

    def _touch_dir(self, ino: int, now: int = 0) -> None:
        d = self.inodes[ino]
        d.mtime_ns = d.ctime_ns = now or time.time_ns()

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
        del self.directory(old_parent)[old]
        dst_entries[new] = src.ino
        now = time.time_ns()
        src.ctime_ns = now
        src.parent, src.name = new_parent, new
        if src.is_dir and old_parent != new_parent:
            self.inodes[old_parent].nlink -= 1
            self.inodes[new_parent].nlink += 1
        self._touch_dir(old_parent, now)
        self._touch_dir(new_parent, now)
        ops += [Undentry(old_parent, old), Dentry(new_parent, new, src.ino), src.record()]
        ops += [self.inodes[old_parent].record(), self.inodes[new_parent].record()]
        self._log(ops)
        return victim

    def _exchange(self, p1: int, n1: bytes, p2: int, n2: bytes) -> None:
        """renameat2(RENAME_EXCHANGE): ``p1/n1`` and ``p2/n2`` swap inodes. A directory
        moved to the other parent takes its '..' along (``parent``) and moves one link
        of its old parent's count to the new one; neither may land in its own subtree."""
        e1, e2 = self.directory(p1), self.directory(p2)
        a, b = self.inodes[e1[n1]], self.inodes[e2[n2]]
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
        e1[n1], e2[n2] = b.ino, a.ino
        a.parent, a.name, b.parent, b.name = p2, n2, p1, n1
        now = time.time_ns()
        a.ctime_ns = b.ctime_ns = now
        self._touch_dir(p1, now)
        self._touch_dir(p2, now)
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
            cur = self.inodes[cur].parent

    def drop(self, inode: Inode) -> None:
        """Forget an inode that has no names left and no users."""
        assert inode.nlink == 0 or inode.flags & FLAG_WRITING
        del self.inodes[inode.ino]
        self._dirs -= inode.is_dir
        self._log([Drop(inode.ino)])

    def commit(self, inode: Inode) -> None:
        """Log an inode's current persistent state."""
        self._log([inode.record()])

    def set_xattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        inode = self.get(ino)
        if len(name) > XATTR_NAME_MAX or (value is not None and len(value) > XATTR_VALUE_MAX):
            raise NameTooLong("xattr name or value too long")
        if value is None and (not inode.xattrs or name not in inode.xattrs):
            raise NoAttribute(name.decode(errors="replace"))
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
